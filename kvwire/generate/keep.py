"""Writing a compiled step's package: AOTInductor compiles an exported step into a `.pt2` file and
its record (what it was made for, its sha256) goes beside it as `.json`. Shared by a build in the
generating process (`ahead`) and one in a child process (`background`)."""
import hashlib
import json
import os

import torch

from .compiled import inductor_options


def keep(program, path, record):
    """AOTInductor-compile the exported `program` into the package at `path`, then write `record`
    (with the package's sha256) beside it; nothing half-written is left, and the record comes last:
    a package without its record is never used. Runs in the generating process or a child (`background`)."""
    tmp = path.with_name(f".{os.getpid()}.{path.name}")  # AOTInductor wants a .pt2 name
    meta_tmp = tmp.with_suffix(".json")
    try:
        options = {**inductor_options(), "aot_inductor.package_constants_in_so": False}
        torch._inductor.aoti_compile_and_package(program, package_path=str(tmp), inductor_configs=options)
        meta_tmp.write_text(json.dumps({**record, "sha256": file_digest(tmp)}))
        os.replace(tmp, path)
        os.replace(meta_tmp, path.with_suffix(".json"))
    finally:
        tmp.unlink(missing_ok=True)
        meta_tmp.unlink(missing_ok=True)


def file_digest(path):
    """sha256 hex of the file at `path`."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
