"""The installed package exposes one import name with passes and models under it."""
import fxmem
import fxmem.models
import fxmem.passes


def test_one_import_name():
    assert fxmem.passes.__name__ == "fxmem.passes"
    assert fxmem.models.__name__ == "fxmem.models"
    assert callable(fxmem.plan) and callable(fxmem.optimize)
