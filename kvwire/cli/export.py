"""`kvwire export`: the (steered) model's cached graph to an .onnx, .pte or .mlpackage file."""
import sys

from ..quant import SCHEMES
from .options import load_model, model_options, steer_options


def add(commands):
    e = commands.add_parser("export", help="export the (steered) model's cached graph to a file",
                            description="Export the cached graph plus head as one model: .onnx, .pte "
                            "(ExecuTorch) or .mlpackage (Core ML). Run .onnx / .pte files with kvwire generate "
                            "--runtime onnx|executorch --model FILE.")
    e.add_argument("output", help="output file, e.g. model.onnx")
    model_options(e)
    steer_options(e)
    e.add_argument("--max-length", type=int, default=None, metavar="N", help="cache length (default 1024)")
    e.add_argument("--format", default=None, choices=["onnx", "executorch", "coreml"], help="when the suffix is unclear")
    e.add_argument("--quantize", default=None, choices=SCHEMES, help="ONNX weight-only quantisation")
    e.add_argument("--batch-size", type=int, default=1, metavar="N", help="rows per call (ExecuTorch, Core ML)")
    e.add_argument("--delegate", default="xnnpack", choices=["xnnpack", "portable"], help="ExecuTorch kernels")
    e.add_argument("--prefill-length", type=int, nargs="+", default=None, metavar="N",
                   help="static prefill chunk length(s) besides the decode step (ExecuTorch: default 64 8; "
                        "Core ML: one, default 64)")
    e.add_argument("--overwrite", action="store_true", help="replace an existing file")
    e.set_defaults(run=run)


def run(args):
    from ..export import export

    lm = load_model(args)
    report = export(lm, args.output, max_length=args.max_length, batch_size=args.batch_size, format=args.format,
                    overwrite=args.overwrite, quantize=args.quantize, delegate=args.delegate,
                    prefill_length=tuple(args.prefill_length) if args.prefill_length else None)
    print(f"wrote {report['path']} ({report['format']}, {report['bytes'] / 1e6:.1f} MB) in "
          f"{report['seconds']:.1f} s", file=sys.stderr)
