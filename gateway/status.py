"""`pdserve status`: the nodes per role with state and load, the local nodes' restarts and crash loops
(`pdserve up`: the actuator's supervised slots, with a crashing node's last log lines), and the
autoscaler's last decision."""

from __future__ import annotations

import json


def add_arguments(p) -> None:
    p.add_argument("--url", default=None, help="the gateway (default: [gateway] url of the config file, else "
                   "http://127.0.0.1:8000)")  # fmt: skip
    p.add_argument("--config", metavar="FILE", help="the config file (else $PDSERVE_CONFIG)")
    p.add_argument("--json", action="store_true")


def main(args) -> int:
    import time

    import httpx

    from paramstore.config import config_path, env_secret, read_config

    from .main import gateway_url

    args.url = gateway_url(read_config(config_path(args.config)), args.url)
    headers = {}
    key = env_secret("PDSERVE_ADMIN_KEY")  # or $PDSERVE_ADMIN_KEY_FILE, as the gateway reads it
    if key:
        headers["Authorization"] = f"Bearer {key}"
    r = httpx.get(args.url + "/admin/status", headers=headers, timeout=5)
    r.raise_for_status()
    st = r.json()
    if args.json:
        print(json.dumps(st, indent=1))
        return 0
    print(f"model {st['model']}: {st['running']} running, {st['queue_depth']} queued at the gateway")
    print(f"{'ROLE':8} {'STATE':10} {'URL':28} {'RUN':>4} {'QUEUED_TOK':>10} {'KV_USED':>8}")
    for n in sorted(st["nodes"], key=lambda n: (n["role"], n["url"])):
        ld = n.get("load", {})
        print(f"{n['role']:8} {n['state']:10} {n['url']:28} {ld.get('running', 0):>4} "
              f"{ld.get('queued_prompt_tokens', 0):>10} {ld.get('kv_blocks_used', 0):>4}/{ld.get('kv_blocks_total', 0)}")  # fmt: skip
    _print_supervised(st.get("supervisor"))
    a = st.get("autoscaler") or {}
    if not a:
        print("autoscaler: not running")
        return 0
    age = f", {time.time() - a['received']:.0f} s ago" if isinstance(a.get("received"), (int, float)) else ""
    print(f"autoscaler ({a.get('actuator', '?')}{age}): {a.get('reason') or a.get('note') or 'no decision yet'}"
          + (f"; error: {a['error']} ({a.get('failures', 0)} in a row)" if a.get("error") else ""))  # fmt: skip
    return 0


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
