"""`kvwire info`: this machine's CPU features and the kernel paths kvwire takes."""
from .. import info


def add(commands):
    i = commands.add_parser("info", help="this machine's CPU features and the kernel paths kvwire takes",
                            description="Print kvwire's and torch's versions, the CPU's features, the bfloat16 "
                            "GEMM path and ggml kernel chosen from them (and the variables overriding them), "
                            "devices, optional packages and the cache. Exits 1 if a setting is invalid.")
    i.add_argument("--json", action="store_true", help="print JSON")
    i.set_defaults(run=run)


def run(args):
    return info.main(args.json)
