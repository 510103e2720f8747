"""llama.cpp on the embedded GGUF, the peer for GGUF on a CPU (issue 25); not run by CI.

    .venv/bin/python benchmarks/llama_cpp_bench.py [--threads 2] [-p 128] [-n 128] [--reps 3] [--json out.json]

Builds `llama-bench` and `llama-batched-bench` once from llama.cpp's sources as the llama-cpp-python
source package ships them (`pip download --no-binary :all: llama-cpp-python`, vendor/llama.cpp;
cmake, Release, native ISA) into ~/.cache/shardserve/llama.cpp (or $SHARDSERVE_LLAMA_CPP_DIR), then
runs `llama-bench -m <embedded gguf> -t 2 -p 128 -n 128 -o json`: prompt processing (pp128) and
generation (tg128) in tokens/s; and `llama-batched-bench -npp 128 -ntg 128 -npl 16`: 16 sequences
at once, the generated tokens over the whole job's time (prompts included), the offline figure.
The build takes several minutes on 2 cores; later runs reuse it. `run()` and `run_batched()` are
what benchmarks/gguf_cpu.py calls to put llama.cpp in the same run as our paths.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tarfile

PACKAGE = "llama-cpp-python"


def cache_dir() -> str:
    return os.environ.get("SHARDSERVE_LLAMA_CPP_DIR") or os.path.expanduser("~/.cache/shardserve/llama.cpp")


def _source_tree(root: str) -> str:
    """vendor/llama.cpp of the newest sdist in `root`, downloaded and unpacked on first use."""
    sdists = sorted(glob.glob(os.path.join(root, "llama_cpp_python-*.tar.gz")))
    if not sdists:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", PACKAGE,
                        "-d", root], check=True)
        sdists = sorted(glob.glob(os.path.join(root, "llama_cpp_python-*.tar.gz")))
    unpacked = sdists[-1][:-len(".tar.gz")]
    if not os.path.isdir(unpacked):
        with tarfile.open(sdists[-1]) as tar:
            tar.extractall(root, filter="data")
    return os.path.join(unpacked, "vendor", "llama.cpp")


TOOLS = ("llama-bench", "llama-batched-bench")


def build(tool: str = "llama-bench") -> str:
    """The path of `tool`, built if missing (Release, GGML_NATIVE: the best ISA this CPU has)."""
    root = cache_dir()
    binary = os.path.join(root, "build", "bin", tool)
    if os.path.exists(binary):
        return binary
    os.makedirs(root, exist_ok=True)
    source = _source_tree(root)
    out = os.path.join(root, "build")
    subprocess.run(["cmake", "-S", source, "-B", out, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
                    "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                    "-DLLAMA_BUILD_SERVER=OFF"], check=True)
    subprocess.run(["cmake", "--build", out, "--target", *TOOLS, "-j", str(os.cpu_count() or 2)], check=True)
    return binary


def embedded_gguf() -> str:
    from shardserve.models.loader import default_model_path
    return default_model_path()


def run(threads: int = 2, prompt: int = 128, gen: int = 128, reps: int = 3,
        model: str | None = None) -> dict[str, float]:
    """{"pp_tok_s": prompt processing, "tg_tok_s": generation} of one llama-bench run (mean of its reps)
    on `model` (default: the embedded GGUF)."""
    cmd = [build(), "-m", model or embedded_gguf(), "-t", str(threads), "-p", str(prompt), "-n", str(gen),
           "-r", str(reps), "-o", "json"]
    rows = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    result: dict[str, float] = {}
    for row in rows:
        key = "pp_tok_s" if row["n_prompt"] and not row["n_gen"] else "tg_tok_s"
        result[key] = float(row["avg_ts"])
        result["build"] = row.get("build_commit", "")
        result["backend"] = row.get("cpu_info", "") + " " + row.get("backends", "")
    return result


def run_batched(threads: int = 2, prompt: int = 128, gen: int = 128, sequences: int = 16) -> dict[str, float]:
    """{"batched_tok_s": generated tokens / the whole job's seconds} for `sequences` at once."""
    cmd = [build("llama-batched-bench"), "-m", embedded_gguf(), "-t", str(threads), "-c",
           str(sequences * (prompt + gen)), "-b", "2048", "-ub", "512", "-npp", str(prompt), "-ntg", str(gen),
           "-npl", str(sequences), "--output-format", "jsonl"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    row = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    return {"batched_tok_s": sequences * gen / float(row["t"])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("-p", "--prompt", type=int, default=128)
    p.add_argument("-n", "--gen", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    result = run(args.threads, args.prompt, args.gen, args.reps) | run_batched(args.threads, args.prompt, args.gen)
    print(f"llama.cpp {result.get('build', '')}, {args.threads} threads: pp{args.prompt} {result['pp_tok_s']:.1f} "
          f"tok/s, tg{args.gen} {result['tg_tok_s']:.1f} tok/s, 16 sequences {result['batched_tok_s']:.1f} "
          "generated tok/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
