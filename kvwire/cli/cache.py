"""`kvwire cache prune`: remove what no load or compile on this machine uses again."""
import json

from .. import info


def add(commands):
    c = commands.add_parser("cache", help="the cache folder: `cache prune` removes what is never used here again")
    actions = c.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = actions.add_parser("prune", help="remove superseded converted models and foreign compiled steps",
                           description="Remove from the cache folder ($KVWIRE_CACHE, default ~/.cache/kvwire) "
                           "converted models whose GGUF file changed or is gone, and compiled steps made for "
                           "another torch or CPU (never loaded here; another virtual environment sharing the "
                           "folder builds its own again when it next compiles). `kvwire info` counts both.")
    p.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=run)


def run(args):
    done = info.prune(dry_run=args.dry_run)
    if args.json:
        print(json.dumps({**done, "dry_run": args.dry_run}, indent=2))
        return 0
    verb = "would remove" if args.dry_run else "removed"
    for path in done["models"] + done["steps"]:
        print(f"{verb} {path}")
    print(f"{verb} {len(done['models'])} superseded converted models and {len(done['steps'])} compiled steps "
          f"made for another torch or CPU: {done['bytes'] / 1e6:.1f} MB")
    return 0
