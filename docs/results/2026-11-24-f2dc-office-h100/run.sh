#!/usr/bin/env bash
# F²DC paper protocol on the real Office-Caltech-10 (issue 13). Usage: bash .gpu/f2dc_office.sh OUTDIR JOBS BUDGET_S [ROUNDS EPOCHS]
set -uo pipefail
OUTD=$1; JOBS=$2; BUDGET=$3; ROUNDS=${4:-}; EPOCHS=${5:-}
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$OUTD"
$PY - "$ROUNDS" "$EPOCHS" <<'PYEOF'
import sys, yaml
rounds, epochs = sys.argv[1], sys.argv[2]
root = yaml.safe_load(open("params.yaml"))
root["sources"]["office_caltech10"] = {"mode": "local", "path": ".gpu/office_caltech_10"}
root["datasets"]["office_caltech10"]["workers"] = 0
root["tracking"]["enabled"] = False
yaml.safe_dump(root, open(".gpu/root.yaml", "w"), sort_keys=False)
p = yaml.safe_load(open("pipelines/f2dc/paper/params.yaml"))
p["data"] = ".gpu/root.yaml"
p["params_file"] = ".gpu/f2dc.yaml"; p["repo_root"] = ".."
p["tracking"]["enabled"] = False
p["experiments"] = {"f2dc_office": p["experiments"]["f2dc_office"]}
p["runs"] = {g: {**r, "experiments": ["f2dc_office"]} for g, r in p["runs"].items() if "f2dc_office" in r["experiments"]}
if rounds:
    for e in p["experiments"].values():
        e["train"]["rounds"] = int(rounds); e["train"]["local_epochs"] = int(epochs)
yaml.safe_dump(p, open(".gpu/f2dc.yaml", "w"), sort_keys=False)
PYEOF
F="$PY -m fedsilo.cli"
date -u +%FT%TZ > "$OUTD/started"
$F --params .gpu/root.yaml fetch --source office_caltech10 2>&1 | tail -3
/usr/bin/time -v $F --params .gpu/root.yaml harmonize --dataset office_caltech10 2>&1 | tail -25 | grep -E "Elapsed|Maximum|images|error|Error" 
cp data/harmonized/office_caltech10/*.json data/harmonized/office_caltech10/*.csv "$OUTD/" 2>/dev/null
$F --params .gpu/f2dc.yaml split --experiment f2dc_office 2>&1 | tail -3
mkdir -p "$OUTD/logs"
jobs_list() {
  if [ -n "${JOBLIST:-}" ]; then for s in ${SEEDS:-0}; do for m in $JOBLIST; do echo "$m $s"; done; done; return; fi
  for s in 0 1 2; do
    for m in f2dc fedavg fedprox moon fpl fedtgp fedrcl fedheal fedsa fdse_office; do echo "$m $s"; done
    [ "$s" = 0 ] && for m in f2dc_no_dfd f2dc_no_dfc f2dc_no_daa; do echo "$m $s"; done
  done
}
export F OUTD
jobs_list | timeout "$BUDGET" xargs -P "$JOBS" -L 1 bash -c 'm=$0; s=$1; start=$(date +%s); $F --params .gpu/f2dc.yaml train --experiment f2dc_office --method $m --seed $s > "$OUTD/logs/$m-seed$s.log" 2>&1; echo "$m seed$s rc=$? $(( $(date +%s) - start ))s"'
echo "xargs/timeout rc=$?"
# (the runs themselves are stopped by timeout above; a pkill -f "fedsilo.cli" here also matched the calling shell)
date -u +%FT%TZ > "$OUTD/ended"
# finished runs: everything but the model; unfinished: the history the checkpoint holds
( cd results && find . -path '*f2dc_office*' -type f ! -name '*.pt' -print0 | xargs -0 -I{} cp --parents {} "$OUTD/" ) 2>/dev/null
$PY - "$OUTD" <<'PYEOF'
import json, sys, pathlib, torch
out = pathlib.Path(sys.argv[1]) / "partial"
for ck in pathlib.Path("state").rglob("checkpoint.pt"):
    if "f2dc_office" not in str(ck):
        continue
    d = torch.load(ck, weights_only=False, map_location="cpu")
    dst = out / ck.parent.relative_to("state"); dst.mkdir(parents=True, exist_ok=True)
    (dst / "history.json").write_text(json.dumps(d.get("history"), default=str))
    print("partial", ck.parent, "round", d.get("round"))
PYEOF
tar -C "$OUTD" -czf "$OUTD.tgz" . && rm -rf "$OUTD"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
