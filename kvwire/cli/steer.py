"""`kvwire steer train`, `sweep`, `eval` and `calibrate`: train control vectors, sweep their strength,
measure them on an A/B dataset (steerability, side effects) and calibrate their layer and strength."""
import sys

from ..layers.site import ALL_SITES as SITES
from ..steer.vector import DEFAULT_METHOD, METHODS
from .options import model_options


def add(commands):
    st = commands.add_parser("steer", help="control vectors: `steer train`, `sweep`, `eval`, `calibrate`")
    actions = st.add_subparsers(dest="action", required=True, metavar="ACTION")
    t = actions.add_parser("train", help="train a control vector from contrastive prompts",
                           description="Train a control vector from paired prompts (one per line; line i of "
                           "--positive pairs with line i of --negative) and write llama.cpp's GGUF format.")
    t.add_argument("--positive", required=True, metavar="FILE", help="prompts showing the concept")
    t.add_argument("--negative", required=True, metavar="FILE", help="paired prompts showing its opposite")
    t.add_argument("--layers", default=None, metavar="A-B", help="blocks to steer (default: 1 to the last)")
    t.add_argument("--method", default=DEFAULT_METHOD, choices=METHODS)
    t.add_argument("--batch-size", type=int, default=8, metavar="N", help="prompts per forward (default 8)")
    t.add_argument("--site", default="block_out", choices=SITES,
                   help="where in each block states are read, and the vector acts (default %(default)s)")
    t.add_argument("--positions", default="last", metavar="P",
                   help="token positions read: last (default), mean, or a negative index such as -2")
    t.add_argument("--operation", default="add", choices=("add", "ablate", "clamp"),
                   help="what the vector is for, recorded in the file (default %(default)s)")
    t.add_argument("-o", "--output", required=True, metavar="VEC.gguf", help="where to write the vector")
    model_options(t)
    t.set_defaults(run=run_train)
    w = actions.add_parser("sweep", help="a probe and a sample per strength (optionally plotted)",
                           description="Steer with a control vector at each strength; print the probe (mean "
                           "log-probability of the positive words minus the negative words as the next token "
                           "after neutral prompts; default happy vs sad words) and a greedy sample.")
    w.add_argument("--control-vector", required=True, metavar="VEC.gguf", help="the vector to sweep")
    w.add_argument("--strengths", type=float, nargs="+", default=[-1.0, -0.5, 0.0, 0.5, 1.0], metavar="S",
                   help="strengths (default: -1 -0.5 0 0.5 1)")
    w.add_argument("--prompt", default="I think that today is", help="the samples' prompt")
    w.add_argument("--max-new-tokens", type=int, default=24, metavar="N", help="tokens per sample (default 24)")
    w.add_argument("--positive-words", nargs="+", default=None, metavar="W",
                   help="words the vector should make likelier (give the leading space: ' happy')")
    w.add_argument("--negative-words", nargs="+", default=None, metavar="W", help="words it should make rarer")
    w.add_argument("--probe-prompt", action="append", default=None, metavar="TEXT",
                   help="a prompt the probe reads the next word after (repeatable; default: five neutral ones)")
    w.add_argument("--plot", default=None, metavar="SWEEP.png", help="draw probe vs strength and the samples")
    w.add_argument("--json", default=None, metavar="FILE", help="write the result as JSON")
    model_options(w)
    w.set_defaults(run=run_sweep)
    e = actions.add_parser("eval", help="A/B logit difference, steerability and side effects per strength",
                           description="Measure a control vector (added, ablated or clamped, as its file says) "
                           "at each strength on an A/B dataset: the mean logit difference of the positive over "
                           "the negative answer, each example's slope against strength, and the KL and "
                           "perplexity change on neutral text; all strengths run as rows of one batch.")
    c = actions.add_parser("calibrate", help="the best layer and strength under a damage limit",
                           description="Try the vector at each block (and site) and strength; pick the highest "
                           "mean A/B logit difference whose KL and perplexity increase on neutral text stay "
                           "under the limits; write the report, a heatmap and the chosen vector.")
    for p in (e, c):
        p.add_argument("--control-vector", required=True, metavar="VEC.gguf", help="the vector to measure")
        p.add_argument("--dataset", default="sentiment-ab", metavar="NAME|FILE",
                       help="a shipped dataset (sentiment-ab, the default) or a JSONL file: prompt/positive/"
                            "negative or CAA's question/answer_matching_behavior/answer_not_matching_behavior")
        p.add_argument("--strengths", type=float, nargs="+", required=True, metavar="S", help="strengths to try")
        p.add_argument("--neutral", default=None, metavar="FILE", help="neutral text for the side effects "
                       "(default: the package's prose)")
        p.add_argument("--neutral-tokens", type=int, default=128, metavar="N", help="tokens per neutral row")
        p.add_argument("--batch-size", type=int, default=64, metavar="N", help="rows per forward (default 64)")
        p.add_argument("--json", default=None, metavar="FILE", help="write the result as JSON")
        p.add_argument("--plot", default=None, metavar="FILE.png", help="draw the result")
        model_options(p)
    e.add_argument("--generated-only", action="store_true",
                   help="steer each example's answer alone, not its prompt (CAA's convention; the prompts then "
                        "run once)")
    e.set_defaults(run=run_eval)
    c.add_argument("--layers", default=None, metavar="A-B", help="blocks to try (default: the vector's)")
    c.add_argument("--sites", nargs="+", default=None, choices=SITES, metavar="SITE",
                   help="sites to try (default: the vector's)")
    c.add_argument("--max-kl", type=float, default=0.5, metavar="X", help="most KL per neutral token (default 0.5)")
    c.add_argument("--max-ppl-increase", type=float, default=0.25, metavar="X",
                   help="most relative perplexity increase (default 0.25: +25%%)")
    c.add_argument("-o", "--output", default=None, metavar="VEC.gguf", help="write the chosen vector")
    c.set_defaults(run=run_calibrate)


def read_pairs(positive_path, negative_path):
    """Line i of one file pairs with line i of the other; pairs where both lines are blank are
    dropped together (so blank lines never shift the pairing); a blank line facing text, or files
    with different numbers of prompts, are refused with the line number."""
    files = []
    for path in (positive_path, negative_path):
        with open(path, encoding="utf-8") as f:
            lines = [line.rstrip("\r\n") for line in f]
        while lines and not lines[-1].strip():  # trailing blank lines
            lines.pop()
        files.append(lines)
    (pos, neg), (pos_path, neg_path) = files, (positive_path, negative_path)
    if len(pos) != len(neg):
        raise ValueError(f"{pos_path} has {len(pos)} lines and {neg_path} has {len(neg)}; line i of one pairs "
                         f"with line i of the other")
    pairs = []
    for number, (p, n) in enumerate(zip(pos, neg), start=1):
        if not p.strip() and not n.strip():
            continue
        if not p.strip() or not n.strip():
            blank, other = (pos_path, neg_path) if not p.strip() else (neg_path, pos_path)
            raise ValueError(f"line {number} is blank in {blank} but not in {other}; pairs must line up")
        pairs.append((p, n))
    if not pairs:
        raise ValueError(f"{pos_path} and {neg_path} hold no prompt pairs")
    return [p for p, _ in pairs], [n for _, n in pairs]


def run_train(args):
    from ..load import load
    from ..steer import ControlVector

    positive, negative = read_pairs(args.positive, args.negative)
    lm = load(args.model, dtype=args.dtype)
    positions = int(args.positions) if args.positions.lstrip("-").isdigit() else args.positions
    vec = ControlVector.train(lm, positive, negative, layers=args.layers, method=args.method,
                              batch_size=args.batch_size, site=args.site, positions=positions,
                              operation=args.operation)
    vec.save(args.output)
    print(f"wrote {args.output}: {len(vec.layers)} directions (blocks {vec.layers[0]}-{vec.layers[-1]}), "
          f"width {vec.width}, method {vec.method}, {vec.operation} at {vec.site}", file=sys.stderr)


def run_sweep(args):
    import json

    from ..load import load
    from ..steer import ControlVector, WordGap, sweep

    if args.plot and not args.plot.lower().endswith((".png", ".svg", ".pdf")):
        raise ValueError(f"--plot must name a .png, .svg or .pdf file, got {args.plot!r}")
    probe = WordGap(*(args.positive_words, args.negative_words) if args.positive_words or args.negative_words
                    else (), **({"prompts": args.probe_prompt} if args.probe_prompt else {}))
    vector = ControlVector.load(args.control_vector)
    lm = load(args.model, dtype=args.dtype)
    result = sweep(lm, vector, args.strengths, probe=probe, prompt=args.prompt, max_new_tokens=args.max_new_tokens)
    print(result)
    if args.plot:
        result.plot(args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result.to_dict(), f, indent=1)
        print(f"wrote {args.json}", file=sys.stderr)


def _measured(args):
    """(lm, vector, dataset, neutral text) of an `eval` or `calibrate` command, checked."""
    from ..load import load
    from ..steer import ControlVector, dataset

    if args.plot and not args.plot.lower().endswith((".png", ".svg", ".pdf")):
        raise ValueError(f"--plot must name a .png, .svg or .pdf file, got {args.plot!r}")
    data = dataset(args.dataset)
    neutral = None
    if args.neutral:
        with open(args.neutral, encoding="utf-8") as f:
            neutral = f.read()
    vector = ControlVector.load(args.control_vector)
    return load(args.model, dtype=args.dtype), vector, data, neutral


def _write(result, args):
    if args.json:
        result.to_json(args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        result.plot(args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)


def run_eval(args):
    from ..steer import Operation, evaluate

    lm, vector, data, neutral = _measured(args)
    operation = Operation.of(vector, when="generated" if args.generated_only else None)
    r = evaluate(lm, operation, data, args.strengths, neutral=neutral, neutral_tokens=args.neutral_tokens,
                 batch_size=args.batch_size)
    print("| strength | logit diff | KL | perplexity |\n|---:|---:|---:|---:|")
    for row in zip(r.strengths, r.logit_diff, r.kl, r.perplexity):
        print("| {:+.2f} | {:+.3f} | {:.4f} | {:.2f} |".format(*row))
    print(f"steerability {r.slope_mean:+.4f} ± {r.slope_std:.4f}, {100 * r.anti_steerable:.0f}% anti-steerable; "
          f"unsteered perplexity {r.base_perplexity:.2f} ({r.neutral_tokens} tokens of {data.name or 'data'})")
    _write(r, args)


def run_calibrate(args):
    from ..steer import calibrate

    lm, vector, data, neutral = _measured(args)
    r = calibrate(lm, vector, data, args.layers, args.strengths, sites=args.sites, max_kl=args.max_kl,
                  max_ppl_increase=args.max_ppl_increase, neutral=neutral, neutral_tokens=args.neutral_tokens,
                  batch_size=args.batch_size)
    ch = r.choice
    print(f"chosen: block {ch['layer']} ({ch['site']}) at strength {ch['strength']:g}: logit diff "
          f"{ch['logit_diff']:+.3f}, KL {ch['kl']:.4f}, perplexity {100 * ch['ppl_increase']:+.1f}%")
    _write(r, args)
    if args.output:
        r.vector.save(args.output)
        scale = "strength 1 applies it" if ch["operation"] == "add" else f"use strength {ch['strength']:g}"
        print(f"wrote {args.output} (block {ch['layer']}; {scale})", file=sys.stderr)
