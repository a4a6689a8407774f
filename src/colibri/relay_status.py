"""`colibri status`: the baton, the ledger and the latest metrics of a relay, at its head.

Everything is read at one pinned revision (the head sha it shows), so the three views agree.
"""

from __future__ import annotations

from colibri_relay import FileNotFoundInStore, Relay, is_parallel
from colibri_spec import METRICS_FILE, scan_metrics_lines


def collect_status(spec: str) -> dict:
    relay = Relay(spec)
    head, state = relay.status()
    if is_parallel(state):
        from .round_status import collect_round_status

        return collect_round_status(relay, head, state)
    entries = relay.ledger(head)
    latest: dict | None = None
    val: dict | None = None
    if METRICS_FILE in state.payload:
        try:
            raw = relay.store.read_file(METRICS_FILE, head).decode("utf-8", "replace")
        except FileNotFoundInStore:
            raw = ""
        # tolerant: a malformed line, or one of another metrics_version, does not hide the others
        for line in scan_metrics_lines(raw if raw.endswith("\n") else raw + "\n", METRICS_FILE).lines:
            record = line.data
            if record.get("loss") is not None:
                latest = record
            if record.get("val_loss") is not None:
                val = record
    return {
        "store": relay.store.spec,
        "head": head,
        "baton": {"status": state.status, "holder": state.holder, "epoch": state.epoch, "seq": state.seq,
                  "lease_duration_s": state.lease_duration_s, "updated_at": state.updated_at},
        "legs_pushed": state.leg,
        "ledger": [e.model_dump() for e in entries],
        "latest_metrics": _brief(latest),
        "latest_validation": _brief(val),
    }


def _brief(record: dict | None) -> dict | None:
    if record is None:
        return None
    keys = ("step", "kind", "loss", "val_loss", "val_loss_infer", "lr", "phase", "tokens_seen", "tokens_per_s", "mfu")
    return {k: record.get(k) for k in keys if record.get(k) is not None}


def render_status(info: dict) -> str:
    if info.get("mode") == "parallel rounds":
        from .round_status import render_round_status

        return render_round_status(info)
    baton = info["baton"]
    lines = [
        f"relay   {info['store']} @ {info['head'][:12]}",
        f"baton   {baton['status']}" + (f" by {baton['holder']} (epoch {baton['epoch']}, seq {baton['seq']}, "
                                         f"last write {baton['updated_at']})" if baton["status"] == "held" else ""),
        f"legs    {info['legs_pushed']} pushed",
        "",
        f"{'leg':>4}  {'holder':<28} {'steps':>6} {'tokens':>10} {'hours':>7}  {'loss':<17} hardware",
    ]
    for e in info["ledger"][::-1]:
        loss = f"{_num(e.get('loss_start'))} -> {_num(e.get('loss_end'))}"
        lines.append(f"{e['leg']:>4}  {e['holder'][:28]:<28} {e['steps']:>6} {e['tokens']:>10} {e['hours']:>7.3f}  "
                     f"{loss:<17} {e['hardware']}")
    if not info["ledger"]:
        lines.append("      (no legs yet)")
    lines.append("")
    latest, val = info["latest_metrics"], info["latest_validation"]
    if latest:
        lines.append("latest  " + ", ".join(f"{k}={_num(v)}" for k, v in latest.items()))
    if val:
        lines.append("val     " + ", ".join(f"{k}={_num(v)}" for k, v in val.items() if k in ("step", "val_loss",
                                                                                                "val_loss_infer")))
    if not latest:
        lines.append("latest  (no metrics in the payload yet)")
    return "\n".join(lines)


def _num(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
