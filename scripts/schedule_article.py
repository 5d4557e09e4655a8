"""The schedule simulator against the third article's 64-card measurements.

Prints the article's four step times next to the simulator's (fed only the article's phase
times through ``StepWork.from_phases``), async's costs, the tail curve (async's gain over
colocated as the tail's share of generation grows, body, scoring and training fixed), and how
the results move with the workload shape the article does not state (waves, tail share).
The numbers are copied into docs/planner.md; tests/ledger/test_schedule.py asserts them.

    PYTHONPATH=src python scripts/schedule_article.py
"""

from orbitrl.ledger.schedule import StepWork, compare, simulate

GEN, TAIL, SCORE, TRAIN, DEVICES = 602.0, 196.0, 72.0, 136.0, 64
STEPS = {"colocated": 810.0, "separated": 1501.0, "one_step": 764.0, "async": 619.0}
GAIN = {0.1: 1.07, 0.7: 2.55}


def work(tail_share_of_generation=None, **shape) -> StepWork:
    if tail_share_of_generation is None:
        return StepWork.from_phases(GEN, TAIL, SCORE, TRAIN, DEVICES, **shape)
    gen = (GEN - TAIL) / (1 - tail_share_of_generation)
    return StepWork.from_phases(gen, gen - (GEN - TAIL), SCORE, TRAIN, DEVICES, **shape)


def table() -> None:
    w = work()
    t = compare(w, DEVICES, staleness=8)
    print("shape       article  simulated   error  devices r/t")
    for s, ref in STEPS.items():
        x = t[s]
        print(f"{s:10s} {ref:8.0f} {x.step_s:10.0f} {100 * (x.step_s / ref - 1):+7.1f}%  "
              f"{x.rollout_devices}/{x.train_devices}")
    one = t["one_step"]
    sep = simulate("separated", w, DEVICES, one.rollout_devices)
    print(f"separated on the one_step pools ({one.rollout_devices}/{one.train_devices}): "
          f"{sep.step_s:.0f} ({100 * (sep.step_s / STEPS['separated'] - 1):+.1f}%)")
    a = t["async"]
    flops = w.forward_s + w.score_device_s + w.train_device_s  # sampling's forward + score + train
    print(f"async: rollout {a.rollout_s:.0f} s, train {a.train_s:.0f} s, re-prefill {a.reprefill_s:.1f} s "
          f"({100 * a.reprefill_s * a.rollout_devices / flops:.1f}% of the step's flops), "
          f"proximal {a.proximal_s:.0f} s, wait {a.wait_s:.0f} s, staleness {a.staleness}")


def curve() -> None:
    print("tail share  colocated  async   gain  article")
    for f in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7):
        t = compare(work(f), DEVICES, staleness=8)
        c, a = t["colocated"].step_s, t["async"].step_s
        ref = f"{GAIN[f]:.2f}" if f in GAIN else ""
        print(f"{f:10.1f} {c:10.0f} {a:6.0f} {c / a:6.2f}  {ref}")


def sensitivity() -> None:
    print("waves  tail share  colocated separated one_step  async   gain@10%  gain@70%  (error %)")
    for waves in (4, 8, 16):
        for share in (0.0025, 0.005, 0.01, 0.02):
            t = compare(work(waves=waves, tail_share=share), DEVICES, staleness=8)
            errs = [100 * (t[s].step_s / ref - 1) for s, ref in STEPS.items()]
            gains = []
            for f, ref in GAIN.items():
                g = compare(work(f, waves=waves, tail_share=share), DEVICES, staleness=8)
                gains.append(100 * (g["colocated"].step_s / g["async"].step_s / ref - 1))
            print(f"{waves:5d} {share:11.4f} " + " ".join(f"{e:+9.1f}" for e in errs + gains))


if __name__ == "__main__":
    table()
    print()
    curve()
    print()
    sensitivity()
