"""`paramstore`: the admin CLI of the parameter store.

    paramstore [--store URL ...] [--config FILE] [--hmac-key-file F] COMMAND ...
    (the [store] table of the config file: --config, $PDSERVE_CONFIG or $PARAMSTORE_CONFIG)
    import SRC --name NAME [--dtype int8|int4|bf16|fp32] [--k 8 --m 3] [--shard-mb 128]
    import-adapter DIR --base MODEL[@vN] --name NAME   a PEFT LoRA adapter of a stored model (adapters.py)
    ls | show REF | verify REF [--deep] | repair REF | rm REF | gc [--grace S] | warm REF | stats
    plans [show ID | rm ID]     kernel plans per machine class (nodes publish them; see plans.py)
    graphs [show ID | rm ID]    compiled decode-step packages (nodes publish them; see graphs.py)
    keygen FILE                 a new publisher key (Ed25519, paramstore/publisher.py): the private key to FILE
                                (0600, never overwritten), the public key (publisher_pubkey) printed

Every listing takes --json. Exit 0 on success; on error one line on stderr and
exit 2 (bad input, not found, integrity) or 1 (anything unexpected); never a
traceback unless PDSERVE_DEBUG=1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .config import add_store_arguments, store_config
from .errors import StoreError

EXIT_USAGE, EXIT_FAIL, EXIT_UNHEALTHY = 2, 1, 3


def _fail(msg: str) -> int:
    print(f"paramstore: error: {msg}", file=sys.stderr)
    return EXIT_USAGE


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _bar(total: int, desc: str, quiet: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="it", file=sys.stderr, disable=quiet or None, leave=False)


def cmd_import(store, args) -> int:
    from .sources import open_source

    source = open_source(args.src)  # validate before anything is written
    if args.chat_template:
        source.set_chat_template(args.chat_template)
    bar = _bar(len(source.tensor_names), f"import {args.name}", args.quiet)
    res = store.import_model(source, args.name, args.dtype, progress=lambda d, t: bar.update(d - bar.n))
    bar.close()
    m = res.manifest
    out = {"model": m.ref, "dtype": m.dtype, "shards": len(m.shards), "model_bytes": m.model_bytes,
           "stored_bytes": m.stored_bytes, "codec": f"zfec k={m.k} m={m.m}", "seconds": round(res.seconds, 3),
           "quant_error": res.quant_error}  # fmt: skip
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"imported {m.ref}: {len(m.shards)} shards, {_human(m.model_bytes)} model, "
          f"{_human(m.stored_bytes)} stored (zfec {m.k}+{m.m}), {res.seconds:.2f} s")  # fmt: skip
    q = res.quant_error
    if q:
        kinds = f"{q['int4_tensors']} int4 + {q['tensors'] - q['int4_tensors']} int8" if m.dtype == "int4" else "int8"
        print(f"{kinds} quantization: {q['tensors']} tensors, relative RMS error {q['rel_rmse']:.4%}, "
              f"max abs error {q['max_abs_err']:.3g}, worst {q['worst_tensor']} ({q['worst_rel_rmse']:.4%})")  # fmt: skip
    return 0


def cmd_import_adapter(store, args) -> int:
    res = store.import_adapter(args.src, args.base, args.name, k=args.k, m=args.m)
    m, a = res.manifest, res.manifest.adapter
    out = {"adapter": m.ref, "base": a["base"], "ranks": a["ranks"], "targets": a["targets"], "digest": a["digest"],
           "shards": len(m.weight_shards()), "adapter_bytes": m.model_bytes, "stored_bytes": m.stored_bytes,
           "codec": f"zfec k={m.k} m={m.m}", "seconds": round(res.seconds, 3)}  # fmt: skip
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"imported {m.ref}: LoRA adapter of {a['base']}, rank {'/'.join(map(str, a['ranks']))}, "
              f"{','.join(a['targets'])}; {_human(m.model_bytes)}, {_human(m.stored_bytes)} stored "
              f"(zfec {m.k}+{m.m}), {res.seconds:.2f} s")  # fmt: skip
    return 0


def _adapter_row(m) -> dict | None:
    a = m.adapter
    return None if a is None else {"base": a["base"], "ranks": a["ranks"], "targets": a["targets"]}


def cmd_ls(store, args) -> int:
    rows = []
    for name, versions in store.models().items():
        m = store.manifest(f"{name}@v{versions[-1]}")
        rows.append({"name": name, "versions": [f"v{v}" for v in versions], "latest": m.ref, "dtype": m.dtype,
                     "model_bytes": m.model_bytes, "shards": len(m.shards),
                     "adapter": _adapter_row(m)})  # fmt: skip
    if args.json:
        print(json.dumps(rows, indent=1))
    elif not rows:
        print("(no models)")
    else:
        print(f"{'NAME':24} {'LATEST':10} {'DTYPE':6} {'SIZE':>10} {'SHARDS':>6}  VERSIONS")
        for r in rows:
            a = r["adapter"]
            lora = f"  LoRA of {a['base']}, r {'/'.join(map(str, a['ranks']))}, {','.join(a['targets'])}" if a else ""
            print(f"{r['name']:24} {r['latest'].split('@')[1]:10} {r['dtype']:6} {_human(r['model_bytes']):>10} "
                  f"{r['shards']:>6}  {','.join(r['versions'])}{lora}")  # fmt: skip
    return 0


def cmd_show(store, args) -> int:
    m = store.manifest(args.ref)
    health = {h.shard: h for h in store.verify(args.ref)}
    shards = [{"shard": s.name, "kind": s.kind, "layers": s.layers, "tensors": len(s.tensors), "bytes": s.size,
               "fragment_bytes": s.fragment_size, "digest": f"{m.digest}:{s.digest}",
               "placement": [m.locations[f.location] for f in s.fragments],
               "health": health[s.name].status, "bad": health[s.name].bad} for s in m.shards]  # fmt: skip
    cfg = m.config
    info = {"model": m.ref, "created": m.created, "dtype": m.dtype, "quant": m.quant, "codec": f"zfec k={m.k} m={m.m}",
            "digest": m.digest, "model_bytes": m.model_bytes, "stored_bytes": m.stored_bytes,
            "config": cfg, "source": m.source, "adapter": m.adapter, "locations": m.locations,
            "shards": shards}  # fmt: skip
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    print(f"{m.ref}  {cfg.get('architectures', ['?'])[0]}  layers={cfg.get('num_hidden_layers')} "
          f"hidden={cfg.get('hidden_size')} heads={cfg.get('num_attention_heads')}/{cfg.get('num_key_value_heads')} "
          f"vocab={cfg.get('vocab_size')}")  # fmt: skip
    if m.adapter:
        a = m.adapter
        print(f"LoRA adapter of {a['base']}: rank {'/'.join(map(str, a['ranks']))}, targets {', '.join(a['targets'])}, "
              f"digest {a['digest'][:16]}")  # fmt: skip
    print(f"dtype {m.dtype}{' (' + m.quant['scheme'] + ')' if m.quant else ''}; codec zfec k={m.k} m={m.m}; "
          f"{_human(m.model_bytes)} model, {_human(m.stored_bytes)} stored on {len(m.locations)} locations")  # fmt: skip
    print(f"{'SHARD':14} {'LAYERS':12} {'SIZE':>10} {'FRAG':>10}  HEALTH")
    for s in shards:
        layers = ",".join(map(str, s["layers"])) if s["layers"] else "-"
        layers = layers if len(layers) <= 12 else layers[:11] + "…"
        print(f"{s['shard']:14} {layers:12} {_human(s['bytes']):>10} {_human(s['fragment_bytes']):>10}  {s['health']}")
    return 0


def _print_health(report, args) -> int:
    rows = [h.as_dict() for h in report]
    counts = {st: sum(r["status"] == st for r in rows) for st in ("ok", "degraded", "unrecoverable")}
    if args.json:
        print(json.dumps({"summary": counts, "shards": rows}, indent=1))
    else:
        for r in rows:
            if r["status"] != "ok" or r.get("repaired"):
                where = "; ".join(f"f{b['fragment']}@{b['location']}: {b['reason']}" for b in r["bad"])
                extra = f" (rebuilt {r['repaired']})" if r.get("repaired") else ""
                print(f"{r['shard']}: {r['status']}{extra}: {where}")
        print(f"{counts['ok']} ok, {counts['degraded']} degraded, {counts['unrecoverable']} unrecoverable")
    return EXIT_UNHEALTHY if counts["unrecoverable"] else 0


def cmd_verify(store, args) -> int:
    m = store.manifest(args.ref)
    bar = _bar(len(m.shards), f"verify {m.ref}", args.quiet)
    report = store.verify(args.ref, deep=args.deep, progress=lambda: bar.update(1))
    bar.close()
    rc = _print_health(report, args)
    return rc or (EXIT_UNHEALTHY if any(h.status != "ok" for h in report) else 0)


def cmd_repair(store, args) -> int:
    m = store.manifest(args.ref)
    bar = _bar(len(m.shards), f"repair {m.ref}", args.quiet)
    report = store.repair(args.ref, progress=lambda: bar.update(1))
    bar.close()
    return _print_health(report, args)


def cmd_rm(store, args) -> int:
    removed = store.remove(args.ref)
    print(json.dumps({"removed": removed}) if args.json else f"removed {', '.join(removed)} (fragments go at gc)")
    return 0


def cmd_gc(store, args) -> int:
    out = store.gc(grace_s=args.grace)
    print(json.dumps(out) if args.json else
          f"removed {out['removed']} orphan objects ({_human(out['bytes_freed'])}); kept {out['kept_young']} younger than {args.grace:g} s")  # fmt: skip
    return 0


def cmd_warm(store, args) -> int:
    from .cache import CacheConfig, NodeCache

    cache = NodeCache(CacheConfig(dir=args.cache_dir, disk_bytes=int(args.disk_gb * 2**30), memory_bytes=0))
    m = store.manifest(args.ref)
    bar = _bar(len(m.shards), f"warm {m.ref}", args.quiet)
    out = store.warm(args.ref, cache, progress=lambda: bar.update(1))
    bar.close()
    out["cache_dir"] = args.cache_dir
    print(json.dumps(out) if args.json else
          f"warmed {out['model']} into {args.cache_dir}: {out['shards']} shards, {out['already_cached']} already cached, {out['seconds']:.2f} s")  # fmt: skip
    return 0


def cmd_stats(store, args) -> int:
    out = store.stats()
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"{out['models']} models, {out['versions']} versions")
    for loc in out["locations"]:
        state = f"{loc['fragments']} fragments, {_human(loc['bytes'])}" if loc["ok"] else f"DOWN: {loc['error']}"
        print(f"  {loc['url']}: {state}")
    return 0


def _objects(args, noun: str, label: str, objects, empty: str, header: str, row, show) -> int:
    """``paramstore plans|graphs [ls | show ID | rm ID]``: the store's replicated objects of one kind."""
    if args.action == "ls":
        if args.id:
            return _fail(f"{noun} ls takes no ID ({noun} show ID: one {label})")
        rows = objects.list()
        if args.json:
            print(json.dumps(rows, indent=1))
        elif not rows:
            print(empty)
        else:
            print(header)
            for r in rows:
                print(row(r) if r["valid"] else f"{r['id']:16} {'-':>3} {'-':>6}  INVALID: {r['error']}")
        return 0
    if not args.id:
        return _fail(f"{noun} {args.action} needs a {label} ID (paramstore {noun}: the list)")
    if args.action == "rm":
        oid = objects.delete(args.id)
        print(json.dumps({"removed": oid}) if args.json else f"removed {label} {oid}")
        return 0
    print(json.dumps(show(args.id), indent=1))
    return 0


def cmd_plans(store, args) -> int:
    return _objects(args, "plans", "kernel plan", store.plans,
                    "(no kernel plans: a node publishes its machine's after it measures)",
                    f"{'ID':16} {'REV':>3} {'SHAPES':>6}  MACHINE",
                    lambda r: f"{r['id']:16} {r['revision']:>3} {r['shapes']:>6}  {str(r['key']).split(' ', 1)[-1]}",
                    store.plans.get)  # fmt: skip


def cmd_graphs(store, args) -> int:
    def row(r: dict) -> str:
        meta = json.dumps(r["meta"], sort_keys=True)
        meta = meta if len(meta) <= 60 else meta[:59] + "…"
        return f"{r['id']:16} {r['revision']:>3} {_human(r['size']):>10}  {str(r['by'])[:20]:20} {meta}"

    return _objects(args, "graphs", "step graph", store.graphs,
                    "(no step graphs: a node publishes its compiled decode step after it builds one)",
                    f"{'ID':16} {'REV':>3} {'SIZE':>10}  {'BY':20} META", row,
                    lambda gid: store.graphs.get(gid)[0])  # verified: shown only for a package that would load


def cmd_keygen(_store, args) -> int:
    from .publisher import generate

    pub = generate(args.file)
    if args.json:
        print(json.dumps({"private_key_file": args.file, "publisher_pubkey": pub}))
    else:
        print(f"publisher key written to {args.file} (keep it off serving nodes)\n"
              f"publisher_pubkey = \"{pub}\"   # [store] of every process, or $PDSERVE_PUBLISHER_PUBKEY")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="paramstore", description="Admin CLI of the pdserve parameter store")
    add_store_arguments(p)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    sub = p.add_subparsers(dest="cmd", required=True)

    def add(name, fn, help_, json_=True):
        sp = sub.add_parser(name, help=help_)
        sp.set_defaults(fn=fn)
        if json_:
            sp.add_argument("--json", action="store_true", help="machine-readable output")
        return sp

    sp = add("import", cmd_import, "import an HF folder or a GGUF file as a new version")
    sp.add_argument("src")
    sp.add_argument("--name", required=True)
    sp.add_argument("--dtype", default="int8", choices=["int8", "int4", "bf16", "fp32"])
    sp.add_argument("--k", type=int, default=None, help="data fragments per shard (default 8)")
    sp.add_argument("--m", type=int, default=None, help="parity fragments per shard (default 3)")
    sp.add_argument("--shard-mb", type=float, default=None, help="target shard size in MiB (default 128)")
    sp.add_argument("--chat-template", metavar="FILE", default=None, help="a jinja chat template to serve the "
                    "model with instead of its own (e.g. deploy/chat-templates/chatml-tools.jinja: tool calls)")
    sp = add("import-adapter", cmd_import_adapter, "import a PEFT LoRA adapter of a stored model as a new version")
    sp.add_argument("src", metavar="DIR", help="a PEFT adapter directory (adapter_config.json, "
                    "adapter_model.safetensors)")
    sp.add_argument("--base", required=True, metavar="MODEL[@vN]", help="the stored model it adapts (latest version "
                    "if none is named; the version is pinned)")
    sp.add_argument("--name", required=True)
    sp.add_argument("--k", type=int, default=None, help="data fragments per shard (default: the base's)")
    sp.add_argument("--m", type=int, default=None, help="parity fragments per shard (default: the base's)")
    add("ls", cmd_ls, "list models, adapters and versions")
    for name, fn, help_ in (("show", cmd_show, "config, shards, placement and health of a model"),
                            ("repair", cmd_repair, "rebuild lost or corrupt fragments"),
                            ("rm", cmd_rm, "delete NAME@vN (or every version of NAME)")):  # fmt: skip
        add(name, fn, help_).add_argument("ref", metavar="NAME[@vN]")
    sp = add("verify", cmd_verify, "check fragments (--deep: read, hash and decode every shard)")
    sp.add_argument("ref", metavar="NAME[@vN]")
    sp.add_argument("--deep", action="store_true")
    sp = add("gc", cmd_gc, "delete fragments no manifest references")
    sp.add_argument("--grace", type=float, default=3600.0, help="keep orphans younger than this (s)")
    sp = add("warm", cmd_warm, "pre-stage a model into a node-local cache")
    sp.add_argument("ref", metavar="NAME[@vN]")
    sp.add_argument("--cache-dir", default="./.pdserve/cache")
    sp.add_argument("--disk-gb", type=float, default=16.0)
    add("stats", cmd_stats, "fragments and bytes per location")
    sp = add("plans", cmd_plans, "kernel plans per machine class: list, show ID, rm ID")
    sp.add_argument("action", nargs="?", default="ls", choices=["ls", "show", "rm"])
    sp.add_argument("id", nargs="?", metavar="ID", help="a plan id (16 hex digits) or a full machine key")
    sp = add("graphs", cmd_graphs, "compiled decode-step packages: list, show ID, rm ID")
    sp.add_argument("action", nargs="?", default="ls", choices=["ls", "show", "rm"])
    sp.add_argument("id", nargs="?", metavar="ID", help="a step graph id (16 hex digits)")
    sp = add("keygen", cmd_keygen, "a new publisher key pair: plans and step packages signed by it (publisher.py)")
    sp.add_argument("file", metavar="FILE", help="where the private key goes (0600; an existing file is refused)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "keygen":  # no store needed
            return cmd_keygen(None, args)
        if args.cmd == "import":
            cfg = store_config(args, args.k, args.m, shard_mb=args.shard_mb)
        else:
            cfg = store_config(args)
        from .store import ParamStore

        with ParamStore(cfg) as store:
            return args.fn(store, args)
    except StoreError as e:
        return _fail(str(e))
    except KeyboardInterrupt:
        print("paramstore: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # one line, never a traceback (unless debugging)
        if os.environ.get("PDSERVE_DEBUG"):
            raise
        print(f"paramstore: internal error: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_FAIL


if __name__ == "__main__":
    raise SystemExit(main())
