"""`kvwire plot`: draw the model's layer graph with Graphviz."""
import sys

from .options import load_model, model_options, steer_options


def add(commands):
    pl = commands.add_parser("plot", help="draw the layer graph (svg/png/pdf/dot)",
                             description="Draw the model's layer graph with Graphviz. Inserted layers are "
                             "orange; with --cached, the cache inputs and outputs of every layer are drawn.")
    pl.add_argument("output", help="output file: .svg, .png, .pdf or .dot")
    model_options(pl)
    steer_options(pl)
    pl.add_argument("--cached", action="store_true", help="draw the cached graph (layer depth, cache wiring)")
    pl.add_argument("--depth", choices=["block", "layer"], default="block", help="granularity (default: block)")
    pl.set_defaults(run=run)


def run(args):
    from ..graph import plot

    lm = load_model(args)
    plot(lm.cached if args.cached else lm.backbone, args.output, depth=args.depth)
    print(f"wrote {args.output}", file=sys.stderr)
