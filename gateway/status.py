"""`pdserve status`: per model, the gateway's traffic, its nodes by role and state with their load and
prefix cache hit rate (prompt tokens found cached / looked up, from the node's /load), and the autoscaler's
last decision and reason for its keys; the standby runtimes (no model) apart;
the local nodes' restarts and crash loops (`pdserve up`: the actuator's supervised slots, with a
crashing node's last log lines), and the autoscaler's last report with the bound its machine or cluster
puts on serving nodes (machine cores, memory, what Kubernetes can schedule) — why the service did not grow."""

from __future__ import annotations

import json
import sys


def add_arguments(p) -> None:
    p.add_argument("--url", default=None, help="the gateway (default: [gateway] url of the config file, else "
                   "http://127.0.0.1:8000)")  # fmt: skip
    p.add_argument("--config", metavar="FILE", help="the config file (else $PDSERVE_CONFIG)")
    p.add_argument("--json", action="store_true")


def main(args) -> int:
    import time

    import httpx

    from gateway import keyfile
    from gateway.main import gateway_url
    from paramstore.config import config_path, env_secret, read_config

    args.url = gateway_url(read_config(config_path(args.config)), args.url)
    headers = {}
    key = env_secret("PDSERVE_ADMIN_KEY") or keyfile.read(args.url)  # the env as the gateway reads it, else up's file
    if key:
        headers["Authorization"] = f"Bearer {key}"
    r = httpx.get(args.url + "/admin/status", headers=headers, timeout=5)
    if r.status_code == 401:
        why = r.json().get("error", {}).get("message", "") if "json" in r.headers.get("content-type", "") else ""
        print(f"pdserve status: the gateway refused the admin key{' (' + why + ')' if why else ''}: set "
              f"$PDSERVE_ADMIN_KEY, or run from the directory of `pdserve up` (it writes {keyfile.path('PORT')})",
              file=sys.stderr)  # fmt: skip
        return 1
    r.raise_for_status()
    st = r.json()
    if args.json:
        print(json.dumps(st, indent=1))
        return 0
    a = st.get("autoscaler") or {}
    for line in render(st):
        print(line)
    _print_supervised(st.get("supervisor"))
    if not a:
        print("autoscaler: not running")
        return 0
    age = f", {time.time() - a['received']:.0f} s ago" if isinstance(a.get("received"), (int, float)) else ""
    print(f"autoscaler ({a.get('actuator', '?')}{age}): {a.get('reason') or a.get('note') or 'no decision yet'}"
          + (f"; error: {a['error']} ({a.get('failures', 0)} in a row)" if a.get("error") else ""))  # fmt: skip
    for line in capacity_lines(a):
        print(line)
    return 0


def capacity_lines(report: dict) -> list[str]:
    """The bounds the autoscaler's machine or cluster put on serving nodes (autoscaler/capacity.py), one a line."""
    out = []
    for b in report.get("capacity") or []:
        full = b.get("limit", 0) <= b.get("serving", 0)
        out.append(f"  capacity: {b.get('why')}; {b.get('serving')} serving now" + (": held at the bound" if full else ""))
    return out


NODE_HEADER = f"  {'ROLE':8} {'STATE':10} {'URL':28} {'RUN':>4} {'QUEUED_TOK':>10} {'KV_USED':>9} {'PREFIX_HIT':>10}"


def hit_rate(ld: dict) -> str:
    """The node's prefix cache hit rate, in prompt tokens since it started ("-" before its first query)."""
    queries = ld.get("prefix_queries") or 0
    return f"{100 * (ld.get('prefix_hits') or 0) / queries:.1f}%" if queries else "-"


def _node_line(n: dict, ld: dict, state: str) -> str:
    kv = f"{ld.get('kv_blocks_used', 0)}/{ld.get('kv_blocks_total', 0)}"
    return (f"  {n['role']:8} {state:10} {n['url']:28} {ld.get('running', 0):>4} {ld.get('queued_prompt_tokens', 0):>10} "
            f"{kv:>9} {hit_rate(ld):>10}")  # fmt: skip


def render(st: dict) -> list[str]:
    """The lines of `pdserve status` per model: the gateway's traffic for it, its nodes by role and
    state (with that model's load on each), the autoscaler's last decision for its keys ("model/role");
    then the standby runtimes (holding no model) apart."""
    out = [f"gateway: {st['running']} running, {st['queue_depth']} queued"]
    nodes = sorted(st.get("nodes", []), key=lambda n: (n["role"], n["url"]))
    traffic = st.get("models") or {}
    held_by = {m for n in nodes for m in (n.get("models") or {})}
    names = list(dict.fromkeys([*(st.get("served") or []), *traffic, *sorted(held_by)]))
    if not names and st.get("model"):
        names = [st["model"]]
    decided = ((st.get("autoscaler") or {}).get("decision") or {}).get("roles") or {}
    for m in names:
        t = traffic.get(m, {})
        line = f"model {m}: {t.get('running', 0)} running, {t.get('queue_depth', 0)} queued"
        if t.get("held"):
            line += f" ({t['held']} held: no node holds it yet)"
        if t:
            line += (f"; {t.get('requests', 0)} requests, idle {t.get('idle_s', 0):.0f} s; p99 ttft "
                     f"{t.get('ttft_p99_s', 0):.2f} s, tpot {t.get('tpot_p99_s', 0) * 1000:.0f} ms")  # fmt: skip
        out.append(line)
        mine = [n for n in nodes if m in (n.get("models") or {})]
        if mine:
            out.append(NODE_HEADER)
        else:
            out.append("  no node holds it")
        for n in mine:
            ld = n.get("load") or {}
            per = (ld.get("models") or {}).get(m) if isinstance(ld.get("models"), dict) else None
            state = n["state"] if n["state"] in ("unhealthy", "draining") else n["models"][m]
            out.append(_node_line(n, per if isinstance(per, dict) else ld, state))
        for key in sorted(k for k in decided if k.startswith(m + "/")):
            d = decided[key]
            out.append(f"  autoscaler {key.split('/', 1)[1]}: {d.get('current', '?')} -> {d.get('replicas', '?')} "
                       f"replicas: {d.get('reason') or '-'}")  # fmt: skip
    standby = [n for n in nodes if not n.get("models")]
    if standby:
        out.append(f"standby runtimes (no model held): {len(standby)}")
        out.append(NODE_HEADER)
        out.extend(_node_line(n, n.get("load") or {}, n["state"]) for n in standby)
    return out


def _print_supervised(sup: dict | None) -> None:
    """The local actuator's slots (`pdserve up`): restarts, crash loops, and a crashing node's last log lines."""
    if not sup or not sup.get("nodes"):
        return
    print(f"{'SLOT':11} {'STATE':11} {'PID':>7} {'RESTARTS':>8}  LAST EXIT")
    for n in sup["nodes"]:
        pid = n["pid"] if n.get("pid") else "-"
        state = n["state"] + (f" ({n['crashes']} exits)" if n.get("crashes", 0) > 1 and n["pid"] else "")
        wait = f"; restart in {n['restart_in_s']:.1f} s" if n.get("restart_in_s") is not None else ""
        print(f"{n['slot']:11} {state:11} {pid:>7} {n.get('restarts', 0):>8}  {n.get('last_exit') or '-'}{wait}")
        for line in n.get("last_log") or []:
            print(f"    | {line}")
    _print_pool(sup.get("pool"))


def _print_pool(pool: dict | None) -> None:
    """The warm pool (autoscaler/pool.py): standby kept per role, claims done, the last placement and why."""
    if not pool:
        return
    standby = sum(1 for r in pool.get("runtimes", []) if r.get("state") == "standby")
    cap = pool.get("max_runtimes") or {}
    within = f", at most {'/'.join(str(n) for n in cap.values())} runtimes per role" if cap else ""
    print(f"warm pool: {standby} standby runtime(s) (keeps {pool.get('pool_size')} per role{within}); "
          f"{pool.get('claims_done', 0)} claim(s)")  # fmt: skip
    last = pool.get("last_placement")
    if last:
        ready = f", ready in {last['ready_s']:.2f} s" if last.get("ready_s") is not None else ""
        err = f" — failed: {last['error']}" if last.get("error") else ""
        print(f"  last placement: {last['model']}/{last['role']} on {last['url']} ({last['why']}){ready}{err}")
