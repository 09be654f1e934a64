"""`kvwire eval`: lm-evaluation-harness's `simple_evaluate` on a kvwire model (steered or not), offline.

lm-eval's own command takes no plugin models, so this one wraps it with its arguments (their
spellings: --model_args, --num_fewshot, ...; dashed forms work too). The model is lm-eval's
"kvwire" (kvwire.harness) unless --model names another of its models (e.g. hf, to compare).
"""
import importlib
import os

from .options import positive


def add(commands):
    e = commands.add_parser("eval", help="lm-evaluation-harness tasks on a (steered) model, offline",
                            description="Run lm-evaluation-harness's simple_evaluate with the kvwire model: "
                            "--model_args pretrained=PRESET|FOLDER|FILE.gguf[,dtype=...,control_vector=V.gguf,"
                            "strength=S,site=...,ablate=V.gguf,clamp=V.gguf,clamp_lo=L,clamp_hi=H]. Nothing is "
                            "downloaded (HF_HUB_OFFLINE=1, HF_DATASETS_OFFLINE=1): tasks read local data, e.g. "
                            "task YAML files in --include_path. Needs the extra: pip install 'kvwire[eval]'.")
    e.add_argument("--model", default="kvwire", help="lm-eval model type (default: %(default)s)")
    e.add_argument("--model_args", "--model-args", nargs="+", default=[], metavar="K=V[,K=V...]",
                   help="the model's arguments, comma-separated (several groups are joined)")
    e.add_argument("--tasks", "-t", nargs="+", required=True, metavar="TASK",
                   help="task or group names (space- or comma-separated)")
    e.add_argument("--num_fewshot", "--num-fewshot", "-f", type=int, default=None, metavar="N",
                   help="examples in each few-shot context")
    e.add_argument("--limit", "-L", type=float, default=None, metavar="N",
                   help="examples per task at most (a fraction below 1)")
    e.add_argument("--batch_size", "--batch-size", "-b", type=positive, default=None, metavar="N",
                   help="batch size (the kvwire model's default: 16)")
    e.add_argument("--device", default=None, help="where the weights go (default: cpu)")
    e.add_argument("--gen_kwargs", "--gen-kwargs", default=None, metavar="K=V[,K=V...]",
                   help="generation options over the tasks' own (e.g. max_gen_toks=32)")
    e.add_argument("--include_path", "--include-path", default=None, metavar="DIR",
                   help="a folder of task YAML files (searched besides lm-eval's own tasks)")
    e.add_argument("--output_path", "--output-path", "-o", default=None, metavar="PATH",
                   help="folder (or .json file) the results are written to")
    e.add_argument("--log_samples", "--log-samples", "-s", action="store_true",
                   help="with --output_path: also write every request and response")
    e.add_argument("--threads", type=positive, default=None, metavar="N", help="threads of torch's CPU pool")
    e.set_defaults(run=run)


def run(args):
    if args.log_samples and not args.output_path:
        raise ValueError("--log_samples writes the samples next to the results: give --output_path too")
    os.environ["HF_HUB_OFFLINE"] = "1"  # read before lm-eval's imports (datasets, huggingface_hub)
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    try:
        importlib.import_module("kvwire.harness")  # registers the "kvwire" model
    except ImportError as e:
        raise RuntimeError(str(e)) from None
    from lm_eval import simple_evaluate
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import make_table

    tasks = [t for group in args.tasks for t in group.split(",") if t]
    manager = TaskManager(include_path=args.include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f"lm-eval's tasks or {args.include_path}" if args.include_path else \
            "lm-eval's tasks (no --include_path)"
        raise ValueError(f"unknown tasks {unknown}: not among {where}")
    tracker = EvaluationTracker(output_path=args.output_path) if args.output_path else None
    results = simple_evaluate(model=args.model, model_args=",".join(args.model_args), tasks=tasks,
                              num_fewshot=args.num_fewshot, batch_size=args.batch_size, device=args.device,
                              limit=args.limit, gen_kwargs=args.gen_kwargs, task_manager=manager,
                              log_samples=args.log_samples, evaluation_tracker=tracker)
    samples = results.pop("samples", None)
    if tracker is not None:
        tracker.save_results_aggregated(results=results, samples=samples)
        for task in results["configs"] if args.log_samples else ():
            tracker.save_results_samples(task_name=task, samples=samples[task])
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
