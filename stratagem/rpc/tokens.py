"""How strong a cluster token is: an estimate of its random bits, and the one rule every task applies.

Whoever guesses the cluster token can run code on every task of the cluster, so a token must
be random. Counting characters is not enough (``"abcdefgh" * 4`` has 32 characters and 8
different ones, and about 18 bits of secret), so the strength is estimated the way a
compressor would see the token (:func:`token_bits`):

- each character that no rule below explains costs ``log2(alphabet)`` bits, the alphabet being
  the classes of characters the token uses: 16 for hex digits (either case), 10 for decimal
  digits, 26 for each case of letters, 2 more for ``-`` and ``_`` (the URL-safe base64 of
  ``secrets.token_urlsafe``), 3 for ``+/=``, 33 for any other ASCII punctuation, 100 for
  anything beyond ASCII;
- a run of characters that repeats an earlier part of the token (3 characters or more:
  ``"abcabcabc"``, ``"hunter2-hunter2"``) costs only where it starts and how long it is;
- a run of 3 or more characters that step by -1, 0 or +1 (``"aaaa"``, ``"0123456789"``,
  ``"zyx"``) costs only its length.

The rule (:func:`check_token_strength`) asks for :data:`MIN_TOKEN_BITS` (96) estimated bits.
A token from ``secrets`` passes: ``secrets.token_urlsafe(32)`` (43 characters, 256 random bits)
estimates at 235 to 258, ``secrets.token_hex(16)`` (128 bits) at 128 typically and at 98 for the
lowest of 200,000 draws (a random string has a few short repeats and runs by chance). What the estimate cannot see is meaning: a sentence or a word list
estimates high and is no secret. Make tokens with a random generator::

    python -c "import secrets; print(secrets.token_urlsafe(32))"

Example::

    >>> from stratagem.rpc.tokens import token_bits
    >>> round(token_bits("abcdefgh" * 4))
    18
    >>> token_bits("9f86d081884c7d659a2feaa0c55ad015") > 96
    True
"""

from __future__ import annotations

import math
import string

from stratagem.errors import ClusterConfigError

__all__ = ["MAKE_TOKEN", "MIN_TOKEN_BITS", "check_token_strength", "token_bits"]

MIN_TOKEN_BITS = 96
MAKE_TOKEN = "python -c \"import secrets; print(secrets.token_urlsafe(32))\""

_HEX = (frozenset(string.digits + "abcdef"), frozenset(string.digits + "ABCDEF"))
_CLASSES = ((frozenset(string.digits), 10), (frozenset(string.ascii_lowercase), 26),
            (frozenset(string.ascii_uppercase), 26))


def _alphabet(token: str) -> int:
    """How many characters each of ``token``'s could have been: the classes it uses."""
    chars = set(token)
    if chars <= _HEX[0] or chars <= _HEX[1]:
        return 10 if chars <= set(string.digits) else 16
    size = sum(count for members, count in _CLASSES if chars & members)
    symbols = {c for c in chars if c.isascii() and not c.isalnum()}
    if symbols:
        size += 2 if symbols <= set("-_") else 3 if symbols <= set("+/=") else 33
    if any(not c.isascii() for c in chars):
        size += 100
    return max(size, 2)


def token_bits(token: str) -> float:
    """An estimate of the random bits in ``token`` (see the module's docstring): what a
    compressor that knows repeats and runs would need to write it down."""
    per_char = math.log2(_alphabet(token)) if token else 0.0
    codes = [ord(c) for c in token]
    total, i = 0.0, 0
    while i < len(codes):
        best_saving, best_length, best_cost = 0.0, 1, per_char
        for start in range(i):   # a repeat of an earlier part (it may overlap this one)
            length = 0
            while i + length < len(codes) and codes[start + length] == codes[i + length]:
                length += 1
            if length >= 3:
                cost = math.log2(i) + math.log2(length) + 1
                if length * per_char - cost > best_saving:
                    best_saving, best_length, best_cost = length * per_char - cost, length, cost
        step = codes[i] - codes[i - 1] if i else 2
        if -1 <= step <= 1:   # the run from the previous character goes on
            length = 1
            while i + length < len(codes) and codes[i + length] - codes[i + length - 1] == step:
                length += 1
            cost = math.log2(length) + 2
            if length >= 2 and length * per_char - cost > best_saving:
                best_saving, best_length, best_cost = length * per_char - cost, length, cost
        total += best_cost
        i += best_length
    return total


def check_token_strength(token: str, *, source: str = "STRATAGEM_CLUSTER_TOKEN") -> None:
    """Raises ClusterConfigError unless ``token`` is random enough to keep others out.

    The one rule wherever a token enters (the environment, ``stratagem server``, an
    ``RpcServer`` or ``RpcClient`` given one): :func:`token_bits` must reach
    :data:`MIN_TOKEN_BITS`. ``source`` names where the token came from in the message,
    which gives the token's length and estimate, never the token.
    """
    text = token if isinstance(token, str) else ""
    bits = token_bits(text)
    if bits >= MIN_TOKEN_BITS:
        return
    shape = "blank" if not text.strip() else f"{len(text)} character{'s' * (len(text) != 1)}"
    raise ClusterConfigError(
        f"{source} is too weak: it has about {bits:.0f} random bits by stratagem's estimate ({shape}; "
        f"repeats, runs like 'abcd' or '1111', and few kinds of characters count little), and a "
        f"cluster token needs at least {MIN_TOKEN_BITS}, because whoever guesses it can run code on "
        f"every task. Make a random one with `{MAKE_TOKEN}` and give the same one to every task "
        "(`stratagem launch` makes one per job).")
