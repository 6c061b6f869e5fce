"""Every ``Example::`` block in a public docstring runs as written."""

from __future__ import annotations

import doctest
import importlib
import inspect
import pkgutil
import textwrap

import pytest

import stratagem

pytestmark = pytest.mark.timeout(120)


def _examples() -> list[tuple[str, str]]:
    found: dict[str, str] = {}
    for info in pkgutil.walk_packages(stratagem.__path__, "stratagem."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        objects = [module] + [obj for _, obj in inspect.getmembers(module)
                              if (inspect.isclass(obj) or inspect.isfunction(obj))
                              and getattr(obj, "__module__", None) == module.__name__]
        for obj in list(objects):
            if inspect.isclass(obj):
                objects += [m for m in vars(obj).values() if inspect.isfunction(m) or isinstance(m, property)]
        for obj in objects:
            doc = inspect.getdoc(obj.fget if isinstance(obj, property) else obj) or ""
            if "Example::" not in doc:
                continue
            block = doc.split("Example::", 1)[1]
            lines = []
            for line in block.splitlines()[1:]:
                if line.strip() and not line.startswith(" "):
                    break
                lines.append(line)
            code = textwrap.dedent("\n".join(lines))
            name = f"{module.__name__}.{getattr(obj, '__qualname__', '')}".rstrip(".")
            found.setdefault(code, name)
    return sorted((name, code) for code, name in found.items())


EXAMPLES = _examples()
#: words of an example that starts processes (marked multiprocess)
STARTS_PROCESSES = ("run_local_cluster", "launch_local", "subprocess", "Popen", "start_task", "run_task")


def _param(name: str, code: str):
    marks = [pytest.mark.multiprocess] if any(word in code for word in STARTS_PROCESSES) else []
    return pytest.param(name, code, marks=marks, id=name)


@pytest.fixture(autouse=True)
def _no_process_group_left() -> None:
    # an example of a strategy that needs torch.distributed even alone (tensor parallelism on a
    # 1 x 1 mesh starts a one-process group) must not leave it to the tests that follow
    yield
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def test_examples_were_found() -> None:
    assert len(EXAMPLES) >= 15


@pytest.mark.parametrize("name,code", [_param(name, code) for name, code in EXAMPLES])
def test_example_runs(name: str, code: str, capsys: pytest.CaptureFixture) -> None:
    if ">>>" in code:  # doctest style: the shown output is checked too
        test = doctest.DocTestParser().get_doctest(code, {}, name, None, 0)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        runner.run(test)
        assert runner.failures == 0, f"{name}: {runner.failures} doctest failures"
        return
    exec(compile(code, f"<example {name}>", "exec"), {"__name__": "__example__"})
