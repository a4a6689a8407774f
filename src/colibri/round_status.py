"""`colibri status` of a run of parallel rounds: the round, the merger, and per merged round the
workers, tokens and utilisation (mean worker training time / the round's time), from the ledger."""

from __future__ import annotations

from colibri_relay import RoundRelay, rounds_of


def collect_round_status(relay, head: str, state) -> dict:
    rounds = rounds_of(state)
    entries = RoundRelay(relay).ledger(head)
    return {
        "store": relay.store.spec,
        "head": head,
        "mode": "parallel rounds",
        "baton": {"status": state.status, "holder": state.holder, "epoch": state.epoch, "seq": state.seq,
                  "lease_duration_s": state.lease_duration_s, "updated_at": state.updated_at},
        "rounds": rounds.model_dump(),
        "rounds_merged": len(entries),
        "ledger": [e.model_dump() for e in entries],
    }


def render_round_status(info: dict) -> str:
    baton, cfg = info["baton"], info["rounds"]
    lines = [
        f"relay   {info['store']} @ {info['head'][:12]} (parallel rounds, companion {cfg['companion']})",
        "merger  " + (f"{baton['holder']} (epoch {baton['epoch']}, last write {baton['updated_at']})"
                       if baton["status"] == "held" else "none (the next worker to claim the lease merges)"),
        f"rounds  {info['rounds_merged']} merged; training round {cfg['round']}: {cfg['workers']} slots, "
        f"H={cfg['inner_steps']} inner steps, deadline {cfg['round_s']:g}s, outer lr {cfg['outer_lr']:g} "
        f"momentum {cfg['outer_momentum']:g}",
        "",
        f"{'round':>5}  {'merger':<20} {'workers':>7} {'rejected':>8} {'tokens':>9} {'round s':>8} "
        f"{'utilisation':>11}  {'loss (mean end)':<15} max_vio  dead",
    ]
    for e in info["ledger"][::-1]:
        ends = [c["loss_end"] for c in e["contributions"] if c.get("loss_end") is not None]
        loss = f"{sum(ends) / len(ends):.4g}" if ends else "-"
        util = "-" if e.get("utilisation") is None else f"{e['utilisation']:.0%}"
        stats = e.get("stats") or {}
        lines.append(f"{e['round']:>5}  {e['merger'][:20]:<20} {len(e['contributions']):>7} {len(e['rejected']):>8} "
                     f"{e['tokens']:>9} {e['round_s']:>8.1f} {util:>11}  {loss:<15} "
                     f"{stats.get('max_vio', '-')!s:<8} {stats.get('dead_experts', '-')}")
        for j in e["rejected"]:
            lines.append(f"       rejected slot {j['slot']} ({j.get('worker') or '?'}): {j['reason']}: {j['detail'][:80]}")
    if not info["ledger"]:
        lines.append("       (no round merged yet)")
    return "\n".join(lines)
