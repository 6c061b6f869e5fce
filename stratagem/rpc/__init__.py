"""How coordinator, workers and parameter servers talk: authenticated gRPC calls.

- :mod:`~stratagem.rpc.codec` -- ``encode``/``decode``: any picklable object (functions too,
  via cloudpickle), with its tensors framed as raw bytes beside the pickle;
- :mod:`~stratagem.rpc.auth` -- the cluster token (``STRATAGEM_CLUSTER_TOKEN``) and the
  message authentication code (GMAC + HMAC) that every request and reply carries; a
  request's covers its destination server and that server's incarnation, and is checked
  from the metadata before the body is read, and the body before anything is unpickled;
- :mod:`~stratagem.rpc.transport` -- what both ends agree on: the wire protocol, the
  message size limit and the default deadline;
- :mod:`~stratagem.rpc.server` -- :class:`RpcServer` (named handlers at one address, with
  size limits and wire counters);
- :mod:`~stratagem.rpc.client` -- :class:`RpcClient` (``call``, ``call_async``, ``start``), with
  deadlines, reconnection, and errors that name the peer task;
- :mod:`~stratagem.rpc.lane` (framing in :mod:`~stratagem.rpc.lane_frames`) -- a TCP connection
  beside gRPC, same token, for the handlers marked ``fast_lane``; :mod:`~stratagem.rpc.pending`
  -- the handles of calls in flight;
- :mod:`~stratagem.rpc.errors` -- the exceptions a caller can see.

This layer knows nothing of parameters or steps: services (the parameter server in
:mod:`stratagem.ps`, the worker service) are tables of handlers on top of it. It does not
use ``torch.distributed``.

Never fork a process that holds a gRPC object; start servers with spawn or the launcher.

Example::

    >>> import torch
    >>> from stratagem.rpc import RpcClient, RpcServer
    >>> import secrets
    >>> token = secrets.token_urlsafe(32)   # the same in every task: STRATAGEM_CLUSTER_TOKEN
    >>> server = RpcServer("127.0.0.1:0", {"double": lambda t: 2 * t}, token).start()
    >>> client = RpcClient(server.address, token, task="demo")
    >>> client.call("double", torch.ones(2))
    tensor([2., 2.])
    >>> client.close(); server.stop()
"""

from stratagem.rpc.auth import TOKEN_VARIABLE, Authenticator, cluster_token
from stratagem.rpc.codec import decode, encode
from stratagem.rpc.errors import (AuthenticationError, ClockSkewError, CodecError, MessageTooLargeError,
                                  RemoteError, RpcError)
from stratagem.rpc.client import RpcClient
from stratagem.rpc.server import Handler, RpcServer
from stratagem.rpc.transport import DEFAULT_MAX_MESSAGE_BYTES

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES", "TOKEN_VARIABLE", "AuthenticationError", "Authenticator",
    "ClockSkewError", "CodecError", "Handler", "MessageTooLargeError", "RemoteError", "RpcClient", "RpcError",
    "RpcServer", "cluster_token", "decode", "encode",
]
