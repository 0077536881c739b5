"""GGUF reading: validated header/metadata/tensor-info parsing and zero-copy tensor views.

Public interface (stable; other rooms depend on exactly this):

    f = open_gguf(path)          # GGUFFile; a split model is opened from its first file
    f.metadata                   # dict[str, Any]: str | int | float | bool | list (plain Python)
    f.tensors                    # dict[str, TensorInfo] in file order
    f.tensor_data(name)          # np.ndarray[uint8], zero-copy view of the tensor's bytes (mmap)
    f.arch                       # metadata["general.architecture"]
    f.version, f.alignment, f.paths, f.file_size (sum over split files)
    f.close()                    # also a context manager

TensorInfo.shape is in numpy order (outermost first: a weight is (rows, cols)); ``ne`` is
GGUF's order (ne[0] innermost). Every violation raises memfit.errors.GGUFError naming the
offset/field.
"""

from .reader import GGUFFile, TensorInfo, open_gguf

__all__ = ["GGUFFile", "TensorInfo", "open_gguf"]
