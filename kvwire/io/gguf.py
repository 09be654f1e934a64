"""Reading GGUF files with the `gguf` package: metadata, and tensors dequantised to float32."""
import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize
from tqdm.auto import tqdm


class GGUFFile:
    """A GGUF file opened for reading (memory-mapped).

    Example:
        >>> f = GGUFFile("model.gguf")
        >>> f.architecture, f.metadata["gemma3.block_count"]
        ('gemma3', 18)
    """

    def __init__(self, path):
        self.path = str(path)
        try:
            self.reader = GGUFReader(self.path)
        except FileNotFoundError:
            raise
        except Exception as e:  # the gguf package raises many kinds on a bad file
            raise ValueError(f"{self.path} is not a readable GGUF file (truncated or corrupt?): {e}") from e
        self.metadata = {name: _field_value(field) for name, field in self.reader.fields.items()
                         if not name.startswith("tokenizer.ggml.")}

    @property
    def architecture(self):
        return self.metadata.get("general.architecture")

    def field(self, name, default=None):
        """One metadata value, including large tokenizer arrays (read on demand)."""
        field = self.reader.fields.get(name)
        return default if field is None else _field_value(field)

    def tensors(self, progress=True):
        """Yield (name, float32 numpy array in row-major (out, in) layout) for every tensor."""
        items = self.reader.tensors
        for t in tqdm(items, desc=f"dequantising {len(items)} tensors", disable=not progress, leave=False):
            try:
                array = dequantize(t.data, t.tensor_type)
            except NotImplementedError as e:
                raise ValueError(f"{self.path}: tensor {t.name!r} has type {t.tensor_type.name}, which the gguf "
                                 f"package cannot dequantise ({e})") from e
            except Exception as e:
                raise ValueError(f"{self.path}: tensor {t.name!r} could not be read (truncated file?): {e}") from e
            yield t.name, np.asarray(array, dtype=np.float32)


def _field_value(field):
    """A metadata field as a Python value (str, number, bool or list)."""
    if field.types and field.types[0] == GGUFValueType.ARRAY:
        return list(field.contents())
    return field.contents()
