"""Where a process running a GGUF file on kvwire's best CPU path keeps its memory (Linux).

    python bench/rss_breakdown.py FILE.gguf [--threads 2] [--top 8]

Runs what bench/size_scaling.py times (a warm `kw.load(path, quantize="gguf")`, a 512-token prefill,
then 32 tokens for 4 rows) and prints the resident memory after `import torch`, after `import
kvwire`, after the load, the prefill and the decode (VmRSS, VmHWM, anonymous and file-backed, MB),
then the mappings holding most of it (/proc/self/smaps, summed per file; `[heap]` and `[anon]` are
anonymous memory). What it answers: how much of a peak RSS is torch's own footprint, the weights'
blocks, pages of the GGUF file, and what generation allocates. Load the file once before (the
first load converts it for kvwire's cache, and the cold load's peak is not the one of interest).
"""
import argparse
import re
import sys
import time


def status():
    """{VmRSS, VmHWM, RssAnon, RssFile}: this process's, in MB."""
    fields = ("VmRSS", "VmHWM", "RssAnon", "RssFile")
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) // 1024 for k, v in (line.split(":", 1) for line in f) if k in fields}


def mappings(top):
    """[(resident MB, mapping name)] of the `top` largest, summed over the ranges of each name."""
    sizes, name = {}, None
    with open("/proc/self/smaps") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                parts = line.split()
                name = parts[5] if len(parts) > 5 else "[anon]"
            elif line.startswith("Rss:"):
                sizes[name] = sizes.get(name, 0) + int(line.split()[1])
    return sorted(((kb // 1024, n) for n, kb in sizes.items()), reverse=True)[:top]


def show(stage, top=0):
    print(f"{stage:<12} " + "  ".join(f"{k} {v:>5} MB" for k, v in status().items()), flush=True)
    for mb, name in mappings(top):
        print(f"{'':<12} {mb:>5} MB  {name}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="a GGUF file (e.g. one of bench/size_scaling.py's)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--top", type=int, default=8, help="mappings listed after each generation stage")
    args = p.parse_args(argv)
    if not sys.platform.startswith("linux"):
        raise SystemExit("rss_breakdown reads /proc/self: Linux only")
    show("start")
    import torch

    torch.set_num_threads(args.threads)
    show("torch")
    import kvwire as kw

    show("kvwire")
    start = time.perf_counter()
    lm = kw.load(args.model, quantize="gguf", progress=False)
    show(f"load {time.perf_counter() - start:.2f}s")
    ids = torch.randint(100, min(lm.vocab_size, 40000), (1, 512), generator=torch.Generator().manual_seed(0))
    lm.generate(ids, max_new_tokens=1)
    show("prefill 512", args.top)
    lm.generate([ids[0, :16]] * 4, max_new_tokens=32, ignore_eos=True)
    show("decode b4", args.top)


if __name__ == "__main__":
    main()
