"""Measure the playground's responsiveness on the embedded pair (kernel side, with the widget view attached).
Writes runs only into the run store it is given (default: a fresh temporary one) and prints its measurements.

    python -m kvlab.playground.measure [--tokens 64] [--positions 3] [--repeats 10] [--runs DIR]

1. *Live*: each new τ position decodes in the background and streams into the view; reports the
   streamed tokens/s (wall clock, callbacks and plot updates included) beside the same runs' decode
   tokens/s as the decode loop measures it (``tps`` of the stored run), and their ratio.
2. *Stored*: moving τ back and forth between those (now stored) positions; reports the time from
   ``set()`` to redrawn readouts and plots (the view renders synchronously inside ``set``), without
   and with a pinned run overlaid.
3. *Spread*: ``--spread`` prompts × 1 seed: the time from ``set(n_prompts=...)`` to the complete
   mean ± paired-CI readouts once every pair is stored (the first time they are decoded).

All numbers come from one process, side by side. The browser adds a websocket round trip on top
(the browser test prints its own end-to-end figure).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kvlab.playground.measure", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=64, help="N, new tokens per run")
    ap.add_argument("--positions", type=int, default=3, help="new τ positions decoded live")
    ap.add_argument("--repeats", type=int, default=10, help="stored-position moves timed")
    ap.add_argument("--runs", default=None, help="run store folder (default: a fresh temporary one)")
    ap.add_argument("--device", default=None, help="cpu / cuda (default: CUDA when present)")
    ap.add_argument("--spread", type=int, default=3, help="prompts averaged in the spread measurement (0: skip)")
    args = ap.parse_args(argv)
    if args.tokens <= 0 or args.positions <= 0 or args.repeats <= 0:
        ap.error("--tokens, --positions and --repeats must be positive")

    from transformers.utils import logging as hf_logging

    from kvlab.core.data import calibration_file, load_prompts
    from kvlab.train.pair import load_pair
    from kvlab.store import RunStore
    from kvlab.playground import Playground, Settings

    hf_logging.disable_progress_bar()
    teacher, student = load_pair(device=args.device)
    store = RunStore(args.runs or tempfile.mkdtemp(prefix="kvlab-measure-"))
    pg = Playground(teacher, student, store=store, prune_ratios=(0.3,),
                    settings=Settings(prompt=load_prompts()[0]["prompt"], policy="entropy", N=args.tokens),
                    calib_prompts=[r["prompt"] for r in load_prompts(calibration_file(), n=1)], calib_tokens=args.tokens)
    try:
        from kvlab.playground.view import PlaygroundView
        view = PlaygroundView(pg)
    except ImportError:
        view = None
    t0 = time.perf_counter()
    pg.settings = pg.settings.replace(tau_bits=pg.tau_at(90))
    pg.start()
    print(f"device {teacher.device}; store {store.root}; first run + baseline + calibration: "
          f"{time.perf_counter() - t0:.1f} s; view attached: {view is not None}")
    r = pg.ranges["tau_bits"]
    taus = sorted({min(r.hi, max(r.lo, round(pg.settings.tau_bits + (i + 1) * 2 * r.step * (-1) ** i, 6)))
                   for i in range(args.positions)} - {pg.settings.tau_bits})
    rows = []
    for tau in taus:
        pg.set(tau_bits=tau)
        pg.wait()
        live, res = pg.last_live, pg.shown.result
        rows.append((tau, live["tps"], res["tps"], res["refreshes"]))
        print(f"live  τ={tau:5.2f}: streamed {live['tps']:6.1f} tok/s, decode loop {res['tps']:6.1f} tok/s "
              f"(ratio {live['tps'] / res['tps']:.2f}), {res['refreshes']} refreshes")
    times = []
    for i in range(args.repeats):
        pg.set(tau_bits=taus[i % len(taus)])
        assert pg.shown.source == "disk", "a stored position must answer from the store"
        times.append(pg.last_response_s)
    pg.pin()
    pinned = []
    for i in range(args.repeats):
        pg.set(tau_bits=taus[(i + 1) % len(taus)])
        assert pg.shown.source == "disk"
        pinned.append(pg.last_response_s)
    pg.unpin()
    print(f"stored, 1 run pinned (overlaid): median {1000 * statistics.median(pinned):.1f} ms, "
          f"max {1000 * max(pinned):.1f} ms over {len(pinned)} moves")
    if args.spread > 1:
        done = {}
        pg.subscribe(lambda ev, sp: done.setdefault("t", time.perf_counter()) if ev == "spread" and sp is not None
                     and sp.complete else None)
        t0 = time.perf_counter()
        pg.set(n_prompts=args.spread)
        pg.wait()
        print(f"spread over {args.spread} prompts, decoded now: {time.perf_counter() - t0:.1f} s")
        stored_spread = []
        for _ in range(3):
            pg.set(n_prompts=1)
            done.clear()
            t0 = time.perf_counter()
            pg.set(n_prompts=args.spread)
            pg.wait()
            stored_spread.append(done["t"] - t0)
        print(f"spread over {args.spread} stored prompts: set() -> mean ± paired CI readouts complete: median "
              f"{1000 * statistics.median(stored_spread):.0f} ms over {len(stored_spread)} repeats")
    ratio = statistics.median(a / b for _, a, b, _ in rows)
    print(f"stored: set() -> readouts + plots redrawn: median {1000 * statistics.median(times):.1f} ms, "
          f"max {1000 * max(times):.1f} ms over {len(times)} moves (target < 300 ms)")
    print(f"live:   streamed {statistics.median(r[1] for r in rows):.1f} tok/s vs decode loop "
          f"{statistics.median(r[2] for r in rows):.1f} tok/s (median ratio {ratio:.2f}) at N={args.tokens}")


if __name__ == "__main__":
    main()
