"""The installed package exposes one import name with passes and models under it."""
import fxmem
import fxmem.models
import fxmem.passes


def test_one_import_name():
    assert fxmem.passes.__name__ == "fxmem.passes"
    assert fxmem.models.__name__ == "fxmem.models"
    assert callable(fxmem.plan) and callable(fxmem.optimize)


def test_solvers_import_no_torch():
    """Every module under fxmem/solve (and the problem they read) loads without torch."""
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(fxmem.__file__).parent
    names = ["fxmem.problem"] + sorted(
        "fxmem." + ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        for p in (root / "solve").rglob("*.py"))
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n"
            "    assert 'torch' not in sys.modules, name + ' imports torch'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert len(names) > 10


def test_import_is_light():
    """`import fxmem` does not load torch: the public names load on first use."""
    import subprocess
    import sys

    code = "import sys, fxmem; assert 'torch' not in sys.modules; fxmem.plan; assert 'torch' in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
