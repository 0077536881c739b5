"""The IQ lattice tables reach the native core from gguf-py, checked on size and name."""
import numpy as np
import pytest

from memfit import _native
from memfit.quant import tables


def test_tables_are_ggml_grids_from_gguf():
    g = tables.grid("iq2xxs")
    assert g.shape == (256, 8) and set(np.unique(g)) <= {8, 25, 43}
    assert tables.grid("iq3s").shape == (512, 4) and tables.grid("iq1s").shape == (2048, 8)
    assert set(np.unique(tables.grid("iq1s"))) == {-1, 0, 1}
    assert tables.ksigns()[:4].tolist() == [0, 129, 130, 3]  # ggml's ksigns_iq2xs


def test_set_quant_table_refuses_wrong_size_and_name():
    with pytest.raises(ValueError, match="expected 2048"):
        _native.set_quant_table("iq2xxs", np.zeros(10, np.int8))
    with pytest.raises(ValueError, match="unknown quant table"):
        _native.set_quant_table("nope", np.zeros(8, np.int8))


def test_type_without_native_kernel_is_refused_cleanly():
    out = np.empty(128, np.float32)
    with pytest.raises(ValueError, match="not supported"):
        _native.dequantize(41, np.zeros(18, np.uint8), 128, out)  # Q1_0: no kernel
