"""What checkpoint manifests cost (issue 21): xxh3-128 speed, its share of a save, and 8.9B.

A script, not a test. Three numbers:

  MB/s       ``ncpctl.manifest.file_hash`` (mmap, 64 MiB pieces) over one ``--mb`` MiB file of
             random bytes, warm in the page cache as a file just written is; median of
             ``--repeat``. Also xxh3-128 on the same bytes in memory (the hash alone).
  share      a real debug-size save (``recipe.yaml``'s model, ``size: debug``, DeepSpeed ZeRO-0 on
             CPU, AdamW state after one step): ``ncpctl.train.checkpoint.save`` timed whole (the
             manifest included), and the manifest's hashing of the same directory timed apart;
             share = hashing / whole save, median of ``--saves``. Goal: under 5%.
  8.9B       the bytes of an NCP-ArchPreview 8.9B checkpoint with optimizer state (bf16 training
             under ZeRO: 2 B bf16 weights + 4 B fp32 master + 8 B Adam moments per parameter in
             the engine's files, + 4 B per parameter of the fp32 ``model.safetensors``), divided
             by the MB/s above: seconds for one stream, and with the engine files split over 8
             ranks (each hashes its share; rank 0 also the inference view).

    .venv/bin/python bench/checksum.py                  # ~1 minute on 2 busy cores
    .venv/bin/python bench/checksum.py --mb 2048 --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[0] = str(REPO)  # not bench/: its tokenize.py would shadow the standard library


def hash_speed(directory: Path, mb: int, repeat: int) -> dict[str, float]:
    import xxhash

    from ncpctl.manifest import file_hash

    data = os.urandom(mb << 20)
    path = directory / "blob.bin"
    path.write_bytes(data)
    file_hash(path)  # warm-up (page cache, mmap)
    files, memory = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        file_hash(path)
        files.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        xxhash.xxh3_128(data).hexdigest()
        memory.append(time.perf_counter() - t0)
    path.unlink()
    return {"mb": mb, "file_mb_s": mb * 1.048576 / statistics.median(files),
            "memory_mb_s": mb * 1.048576 / statistics.median(memory)}


def debug_save_share(directory: Path, saves: int) -> dict[str, float]:
    """Whole ``save`` vs its hashing, with a real DeepSpeed engine of the debug model."""
    import torch

    from ncpctl import manifest
    from ncpctl.model.core.model import NCPModel
    from ncpctl.recipe import load_recipe
    from ncpctl.train import checkpoint as ckpt
    from ncpctl.train.engine import build_engine, init_distributed

    recipe_path = directory / "r.yaml"
    recipe_path.write_text(f"run: {{dir: {directory / 'run'}}}\nmodel: {{size: debug}}\n"
                           "train: {micro_batch_size: 1, global_batch_size: 1, seq_len: 32}\n"
                           "deepspeed: {zero_stage: 0}\n")
    recipe = load_recipe(recipe_path)
    d = init_distributed()
    engine, _ = build_engine(recipe, NCPModel(recipe.model_config), d)
    for p in engine.module.parameters():  # Adam state exists after one step
        p.grad = torch.randn_like(p) * 1e-3
    engine.optimizer.step()
    root = directory / "run" / "checkpoints"
    whole, hashing, sizes = [], [], []
    for step in range(1, saves + 1):
        meta = {"zero_stage": 0, "tokens_seen": step, "world_size": 1}
        t0 = time.perf_counter()
        path = ckpt.save(engine, root, step, meta, recipe, rank=0, keep_last=1, barrier=lambda: None)
        whole.append(time.perf_counter() - t0)
        names = manifest.files_of(path)
        t0 = time.perf_counter()
        manifest.describe(path, names)
        hashing.append(time.perf_counter() - t0)
        sizes.append(sum((path / n).stat().st_size for n in names))
    return {"save_s": statistics.median(whole), "hash_s": statistics.median(hashing),
            "share": statistics.median(h / w for h, w in zip(hashing, whole)),
            "checkpoint_mb": statistics.median(sizes) / 1e6,
            "parameters": sum(p.numel() for p in engine.module.parameters())}


def big_checkpoint(mb_s: float, ranks: int = 8) -> dict[str, float]:
    import torch

    from ncpctl.model.core.config import build_config
    from ncpctl.model.core.model import NCPModel

    with torch.device("meta"):
        n = sum(p.numel() for p in NCPModel(build_config("ncp-archpreview-8.9b")).parameters())
    engine_bytes, view_bytes = n * (2 + 4 + 8), n * 4
    total = engine_bytes + view_bytes
    return {"parameters": n, "gb": total / 1e9, "one_stream_s": total / 1e6 / mb_s,
            f"ranks_{ranks}_s": (engine_bytes / ranks + view_bytes) / 1e6 / mb_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=1024, help="size of the hashed file in MiB")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        speed = hash_speed(Path(tmp), args.mb, args.repeat)
        share = debug_save_share(Path(tmp), args.saves)
    big = big_checkpoint(speed["file_mb_s"])
    load = os.getloadavg()[0]
    result = {"speed": speed, "debug_save": share, "ncp_archpreview_8_9b": big, "load_1min": load}
    if args.json:
        print(json.dumps(result))
        return
    print(f"xxh3-128, {args.mb} MiB file via mmap: {speed['file_mb_s']:,.0f} MB/s "
          f"(in memory: {speed['memory_mb_s']:,.0f} MB/s); 1-min load {load:.2f}")
    print(f"debug save ({share['parameters']:,} parameters, {share['checkpoint_mb']:.1f} MB): "
          f"{share['save_s'] * 1e3:.0f} ms, hashing {share['hash_s'] * 1e3:.1f} ms = "
          f"{100 * share['share']:.1f}% of the save (goal under 5%)")
    print(f"8.9B with optimizer state: {big['parameters']:,} parameters, {big['gb']:.1f} GB: "
          f"{big['one_stream_s']:.1f} s in one stream, {big['ranks_8_s']:.1f} s over 8 ranks")


if __name__ == "__main__":
    main()
