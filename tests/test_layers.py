"""Imports point one way: serving/ and training/ sit on the runtime (stratum_jax/), never under it.

Parses every module with `ast` (imports inside functions included) and fails naming the file and line
of each import that breaks a rule.
"""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The command-line entry points of stratum_jax/ that start a server, a client or the offline trainer.
ENTRY_POINTS = {"stratum_jax/serve.py", "stratum_jax/client.py", "stratum_jax/train_dmlp.py"}


def modules(package: str) -> list[str]:
    out = []
    for d, _, files in os.walk(os.path.join(ROOT, package)):
        out += [os.path.relpath(os.path.join(d, f), ROOT) for f in files if f.endswith(".py")]
    return sorted(out)


def imports(path: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in a file; relative imports resolved."""
    tree = ast.parse(open(os.path.join(ROOT, path)).read(), path)
    package = os.path.dirname(path).replace(os.sep, ".")
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            out.append((node.lineno, name))
            # `from pkg import sub` imports the submodule pkg.sub too.
            out += [(node.lineno, f"{name}.{a.name}") for a in node.names]
    return out


def under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def violations(files, banned, allowed=frozenset()) -> list[str]:
    return [f"{f}:{line}: imports {name}" for f in files if f not in allowed
            for line, name in imports(f) if any(under(name, b) for b in banned)]


def test_runtime_imports_no_server_or_trainer():
    bad = violations(modules("stratum_jax"), ("serving", "training"), ENTRY_POINTS)
    assert not bad, "the runtime imports serving/ or training/ outside its entry points:\n" + "\n".join(bad)


@pytest.mark.parametrize("package,other", [("stratum_jax/kv", "stratum_jax.dmlp"),
                                           ("stratum_jax/dmlp", "stratum_jax.kv")])
def test_kv_and_dmlp_do_not_import_each_other(package, other):
    bad = violations(modules(package), (other,))
    assert not bad, (f"{package} imports {other} (shared types belong in stratum_jax/block_info.py or "
                     f"cache_policy.py):\n" + "\n".join(bad))


def test_kernels_import_nothing_above_them():
    bad = violations(modules("pallas_kernels"), ("stratum_jax", "serving", "training"))
    assert not bad, "pallas_kernels imports the runtime, the server or the trainer:\n" + "\n".join(bad)


def test_the_checker_sees_imports(tmp_path, monkeypatch):
    # The rules above pass vacuously if `imports` misses an import form; check each form is seen.
    src = ("import training.traces\nfrom training import pipeline\nfrom ..dmlp import policy\n"
           "def f():\n    from serving.server import StratumServer\n")
    os.makedirs(tmp_path / "stratum_jax" / "kv")
    (tmp_path / "stratum_jax" / "kv" / "x.py").write_text(src)
    monkeypatch.setattr(__import__(__name__), "ROOT", str(tmp_path))
    found = {name for _, name in imports("stratum_jax/kv/x.py")}
    assert {"training.traces", "training.pipeline", "stratum_jax.dmlp.policy", "serving.server"} <= found
    lines = {v.split(":")[1] for v in violations(["stratum_jax/kv/x.py"], ("training", "serving"))}
    assert lines == {"1", "2", "5"}
    assert [v.split(":")[1] for v in violations(["stratum_jax/kv/x.py"], ("stratum_jax.dmlp",))] == ["3", "3"]
