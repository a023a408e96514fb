"""The host's work on a decode graph step's block tables at B running sequences (CPU):
as before 6bb5ce6, every sequence's whole table (``max_seq_len / block_size`` entries)
gathered into the staged buffer; now only the entries the step's longest sequence uses.
Both in one process, alternated. The host-to-device copy that follows (every row's full
width, launched and not waited for on CUDA) is the same for both: its bytes are printed.

    python docs/bench/step_tables_host.py [B] [ROUNDS]
"""
import random
import statistics
import sys
import time

import torch

BLOCK = 16


def fills(batch: int, width: int, used: int):
    """(name, fill) of each way: fill gathers the step's tables into the staged buffer."""
    slots = torch.randperm(4 * batch)[:batch]
    rows = torch.randint(1, 1 << 20, (4 * batch, width), dtype=torch.int32)
    staged = torch.zeros(batch, width, dtype=torch.int32)

    def whole():
        staged[:] = rows.index_select(0, slots)

    def used_entries():
        staged[:, :used] = rows[:, :used].index_select(0, slots)

    return [("whole tables (before)", whole), ("used entries (now)", used_entries)]


def timed(fn, repeats=50) -> float:
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t) / repeats * 1e6


def main(batch: int = 256, rounds: int = 30):
    torch.set_num_threads(1)
    rng = random.Random(0)
    longest = max(rng.randrange(128, 1500) for _ in range(batch))
    used = -(-longest // BLOCK)
    print(f"{batch} sequences, the longest {longest} tokens ({used} blocks of {BLOCK})")
    print("| max_seq_len | tables | gather + fill us (median) | bytes copied |")
    print("|---|---|---|---|")
    for max_seq_len in (2048, 8192):
        width = max_seq_len // BLOCK
        arms = fills(batch, width, used)
        times = {name: [] for name, _ in arms}
        for _ in range(rounds):
            for name, fill in arms:
                times[name].append(timed(fill))
        for name, _ in arms:
            print(f"| {max_seq_len} | {name} | {statistics.median(times[name]):.1f} | "
                  f"{batch * width * 4} |")


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
