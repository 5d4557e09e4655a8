"""Readable tables for a plan document (the dict of :meth:`Plan.to_dict`).

Rendering works from the JSON document, so the text and ``--json`` never disagree.
GB here is 1e9 bytes.
"""

from __future__ import annotations

GB = 1e9


def _gb(b) -> str:
    return "-" if not b else f"{b / GB:,.2f}"


def _table(headers: list[str], rows: list[list], title: str) -> str:
    cells = [[str(c) for c in r] for r in [headers] + rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                              for i, (c, w) in enumerate(zip(r, widths)))
    lines = [title, fmt(cells[0]), "  ".join("-" * w for w in widths)]
    lines += [fmt(r) for r in cells[1:]]
    return "\n".join(lines)


def _memory(doc: dict) -> str:
    ph = doc["phases"]
    keys = sorted({k for p in ("rollout", "score", "train", "host") for k in ph[p]["terms"]})
    rows = [[k] + [_gb(ph[p]["terms"].get(k)) for p in ("rollout", "score", "train", "host")]
            for k in keys]
    rows.append(["total"] + [_gb(ph[p]["total"]) for p in ("rollout", "score", "train", "host")])
    return _table(["term (GB per device)", "rollout", "score", "train", "host"], rows,
                  "memory by phase")


def _roles(doc: dict) -> str:
    rows = [[r, _gb(t["device"]), _gb(t["host"]), _gb(t["disk"])]
            for r, t in doc["roles"].items() if any(t.values())]
    return _table(["role", "device", "host", "disk"], rows,
                  "memory by role (GB per device; device at the role's own peak phase)")


def _execution(doc: dict) -> str:
    def lay(d):
        return "/".join(str(d[k]) for k in ("tp", "pp", "dp")) if d else "-"
    rows = [[e["role"], ",".join(e["stages"]), lay(e["parallel"].get("training")),
             lay(e["parallel"].get("generation") or e["parallel"].get("inference")),
             e["precision"], e["tier"], "yes" if e["requires_grad"] else "no"]
            for e in doc["execution"]]
    return _table(["role", "stages", "train tp/pp/dp", "gen|infer tp/pp/dp", "precision", "tier",
                   "grad"], rows, "execution plan")


def _bandwidth(doc: dict) -> str:
    bw = doc["bandwidth"]
    rows = [[t["name"], t["link"], _gb(t["bytes"]), f"{t['seconds']:.2f}", f"{t['exposed']:.2f}"]
            for t in bw["transfers"]]
    return _table(["transfer (per device per step)", "link", "GB", "seconds", "exposed s"], rows,
                  "bytes moved per step (weight sync applies to separate pools only)")


def _schedule(doc: dict) -> str:
    sch = doc["schedule"]
    rows = [[s["shape"], f"{s['step_s']:.1f}", f"{s['rollout_s']:.1f}", f"{s['train_s']:.1f}",
             f"{s['sync_s']:.2f}", f"{100 * s['utilisation']:.0f}%", s["staleness"],
             f"{s['rollout_devices']}/{s['train_devices']}"] for s in sch["shapes"].values()]
    b = sch["breakdown"]
    tail = (f"colocated step {b['step_s']:.1f} s = rollout {b['rollout_s']:.1f} + score "
            f"{b['score_s']:.1f} + train {b['train_s']:.1f} + exposed comm {b['exposed_comm_s']:.1f}")
    a = sch["shapes"].get("async")
    if a and "reprefill_s" in a:
        tail += (f"\nasync pays: re-prefill {a['reprefill_s']:.2f} s (rollout pool), proximal pass "
                 f"{a['proximal_s']:.2f} s (training pool), staleness wait {a['wait_s']:.2f} s, "
                 f"dropped {100 * a['dropped_share']:.1f}%")
    if sch.get("balance"):
        tail += (f"\nbalanced pools (async): {sch['balance']['rollout_devices']} rollout : "
                 f"{sch['balance']['train_devices']} training devices")
    return _table(["shape", "step s", "rollout s", "train s", "sync s", "util", "stale",
                   "devices r/t"], rows, "step time by schedule shape") + "\n" + tail


def render(doc: dict) -> str:
    """The human report: verdict, then memory, roles, execution, bytes moved and step time."""
    m, s, c = doc["model"], doc["strategy"], doc
    kind = s["kind"] + (f" (base {s['base_dtype']})" if s["kind"] == "adapter" else "")
    head = [f"model {m['name']}: {m['params'] / 1e9:,.1f}B params ({m['active_params'] / 1e9:,.1f}B "
            f"active), {m['layers']} layers, hidden {m['hidden']}; strategy {kind}",
            f"cluster {c['devices']} x {c['device_memory_bytes'] / GB:g} GB, "
            f"host {c['host_memory_per_node'] / GB:g} GB per node; tp {c['tp']}",
            f"{'FITS' if c['fits'] else 'DOES NOT FIT'}: peak {_gb(c['per_device_bytes'])} GB per "
            f"device of {_gb(c['usable_bytes_per_device'])} GB usable; host "
            f"{_gb(c['host_per_node_bytes'])} GB per node; fewest devices that fit: "
            f"{c['min_devices'] if c['min_devices'] is not None else 'none'}"]
    if c.get("proposal"):
        head.append(f"proposal: {c['proposal']['message']}")
    if c.get("machine"):
        r = c["machine"]
        us = r.get("host_us", {})
        head.append(f"this machine ({r['threads']} threads): {r['device_tflops'] * 1e3:.0f} GFLOP/s "
                    f"fp32, {r['hbm_gbps']:.1f} GB/s copy; us per op (fixed / per layer): "
                    + ", ".join(f"{ph} {us[ph + '_fixed']:.1f} / {us[ph + '_layer']:.1f}"
                                for ph in ("rollout", "score", "train") if ph + "_fixed" in us))
    mb = c["micro_batch"]
    head.append(f"layout: tp {c['tp']} x dp {c['dp']}; {c['layout']['description']}; micro batch "
                f"{mb['sequences']} seq ({mb['tokens']:,} packed tokens)"
                + ((" [auto: fewest that hide the gathers, within memory]"
                    if c["layout"]["weights"] in ("sharded", "host") else
                    " [auto: nothing gathered, so the smallest]") if mb["auto"] else ""))
    kv = c["kv_pool"]
    if kv:
        what = ("fixed by --rollout-seqs" if kv["mode"] != "elastic" else
                "elastic: the memory the rollout phase leaves, up to the step's need"
                if c["fits"] else "elastic, at its reserve: the run does not fit")
        head.append(f"rollout KV pool ({what}): {_gb(kv['bytes_per_device'])} GB per device, "
                    f"{kv['blocks']:,} blocks of {kv['block_tokens']} tokens, holds "
                    f"{kv['concurrent_seqs']:,} concurrent {kv['seq_len']}-token sequences "
                    f"({kv['seqs_per_device']:.1f} per device; step needs {kv['need_seqs']:,}, "
                    f"must fit {kv['reserve_seqs']:,})")
    node = c["cluster_memory_bytes"]
    head.append(f"static (non-KV) peak: {_gb(c['static_per_device_bytes'])} GB per device, "
                f"{_gb(c['static_total_bytes'])} GB over all devices = "
                f"{100 * c['static_total_bytes'] / node:.1f}% of {node / GB:,.0f} GB")
    st = c["state_bytes"]
    head.append(f"model state (whole): {st['total'] / 1e12:,.3f} TB = weights "
                f"{_gb(st['weights'])} + grads {_gb(st['grads'])} + master {_gb(st['master'])} + "
                f"optimizer {_gb(st['optimizer'])} GB")
    return "\n\n".join(["\n".join(head), _memory(doc), _roles(doc), _execution(doc),
                        _bandwidth(doc), _schedule(doc)])
