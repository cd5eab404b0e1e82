#!/usr/bin/env bash
# A whole fedsilo deployment on one machine, to try before the real one: a coordinator (SuperLink with TLS and
# SuperNode authentication) and three hospitals (one SuperNode each, on the chest X-rays it harmonized and split
# itself: offline mirrors of CheXpert and RSNA, and a hospital's own PACS export with its label table, `reader:
# cxr_table`, as "St Marys"). Every process listens on 127.0.0.1 and is stopped
# at the end. Each step is the command the real coordinator or site runs (README, "Deploying across hospitals").
#
#   bash deploy/loopback.sh [WORK_DIR] [METHOD]      # default /tmp/fedsilo-loopback, fedbn; ~5 minutes on 2 idle cores
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mkdir -p "${1:-/tmp/fedsilo-loopback}" && cd "${1:-/tmp/fedsilo-loopback}" && pwd)
METHOD=${2:-fedbn}
PORT=${PORT:-9093}
SITES=(chexpert rsna st_marys)
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1
PIDS=()
stop() {  # SuperNodes first, then the SuperLink; SIGTERM lets each deactivate cleanly
  for ((i=${#PIDS[@]}-1; i>=0; i--)); do kill -TERM "${PIDS[$i]}" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
}
trap stop EXIT
if [[ -e "$WORK/coordinator" ]]; then echo "$WORK already holds a deployment; give another folder" >&2; exit 2; fi

echo "== each hospital: its own data, harmonized and split there; its card; its key pair"
for s in "${SITES[@]}"; do
  mkdir -p "$WORK/$s"
  own=""; tables=""; later=""; external=""
  if [[ $s == st_marys ]]; then  # and a later export, never trained on, to validate the model with at the end
    own="reader: cxr_table, "; tables=", tables: {st_marys: {domain: St Marys}}"
    later=", st_marys_later: {mode: mirror, reader: cxr_table, mirror: {patients: 30, seed: 1}}"
    external=", external: {sources: [st_marys_later], image_size: 16}"
  fi
  cat > "$WORK/$s/params.yaml" <<YAML
sources: {$s: {mode: mirror, ${own}mirror: {patients: 40}}${later}}
datasets: {chest_xray4: {sources: [$s], image_size: 16${tables}}${external}}
experiments: {site: {dataset: chest_xray4, split: {protocol: domain_clients, n_train: 16, n_test: 10}, train: {model: simple_cnn, device: cpu}}}
methods: {single: {}}
pipeline: {sources: [$s], datasets: [chest_xray4], splits: {site: chest_xray4}, experiments: [site], methods: [single], seeds: [0]}
tracking: {enabled: false}
YAML
  (cd "$WORK/$s" && fedsilo -q fetch --source "$s" && fedsilo -q harmonize --dataset chest_xray4 \
     && fedsilo -q split --experiment site && fedsilo site card --experiment site > /dev/null \
     && fedsilo deploy key --out keys --name "$s")
done

echo "== the coordinator: certificates, SuperLink, CLI connection, registrations"
C=$WORK/coordinator
mkdir -p "$C/flwr"
fedsilo deploy certs --out "$C/certs" --host 127.0.0.1 --host localhost
(cd "$C" && FLWR_HOME=$C/superlink-home exec fedsilo deploy superlink --certs certs --database superlink.db \
   --listen "127.0.0.1:$PORT") > "$C/superlink.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 60); do curl -sf --cacert "$C/certs/ca.crt" "https://127.0.0.1:$PORT/health" > /dev/null && break; sleep 0.5; done
export FLWR_HOME=$C/flwr
cat > "$FLWR_HOME/config.toml" <<TOML
[superlink]
default = "loopback"

[superlink.loopback]
address = "127.0.0.1:$PORT"
root-certificates = "$C/certs/ca.crt"
TOML
# each registration's node-id is pinned in federation.yaml: the site's name is then only admitted from its own key
for s in "${SITES[@]}"; do
  flwr supernode register "$WORK/$s/keys/$s.pub" loopback --format json \
    | python -c 'import json,sys; print(json.load(sys.stdin)["node-id"])' > "$WORK/$s/node-id"
  echo "$s registered as node $(cat "$WORK/$s/node-id")"
done

echo "== each hospital starts its SuperNode"
n=0
for s in "${SITES[@]}"; do
  n=$((n + 1))
  (cd "$WORK/$s" && FLWR_HOME=$WORK/$s/flwr-home exec fedsilo site supernode --experiment site --superlink "127.0.0.1:$PORT" \
     --root-certificates "$C/certs/ca.crt" --auth-key "keys/$s" --port $((PORT + 100 + n))) > "$WORK/$s/supernode.log" 2>&1 &
  PIDS+=($!)
done
for _ in $(seq 90); do
  online=$(flwr supernode list loopback --format json | python -c 'import json,sys; print(sum(n["status"] == "online" for n in json.load(sys.stdin)["nodes"]))')
  [[ "$online" == 3 ]] && break; sleep 1
done
echo "$online SuperNodes online"
if [[ "$online" != 3 ]]; then echo "only $online of 3 SuperNodes came online; see $WORK/*/supernode.log" >&2; exit 1; fi

echo "== the federation file (the fingerprints the sites sent), its App, the run"
python - "$WORK" "$METHOD" > "$C/federation.yaml" <<'PY'
import json, sys
import yaml
work, method = sys.argv[1], sys.argv[2]
names = ("chexpert", "rsna", "st_marys")
cards = [json.load(open(f"{work}/{s}/data/site/site.json")) for s in names]
nodes = [int(open(f"{work}/{s}/node-id").read()) for s in names]
print(yaml.safe_dump({"name": "loopback_three_hospitals", "method": method, "seed": 0,
                      "train": {"model": "simple_cnn", "rounds": 3, "batch_size": 8, "lr": 0.05, "device": "cpu"},
                      "contract": cards[0]["contract"],
                      "sites": [{"name": c["site"], "fingerprint": c["fingerprint"], "node_id": n}
                                for c, n in zip(cards, nodes)]}, sort_keys=False))
PY
fedsilo --params "$REPO/params.yaml" deploy app --federation "$C/federation.yaml" --out "$C/app" --results "$C/results" \
  --state "$C/state"   # the ServerApp's checkpoint: `flwr run` of the same App after a restart resumes from it
RUN=$(flwr run "$C/app" loopback --format json | python -c 'import json,sys; print(json.load(sys.stdin)["run-id"])')
flwr log "$RUN" loopback || true   # the ServerApp's lines, until the run ends
flwr list --run-id "$RUN" loopback
STATUS=$(flwr list --run-id "$RUN" loopback --format json | python -c 'import json,sys; print(json.load(sys.stdin)["runs"][0]["status"])')
if [[ "$STATUS" != finished:completed ]]; then echo "run $RUN ended $STATUS" >&2; exit 1; fi
echo "results: $C/results (metrics.json, history.json, wire.jsonl: every message's keys and bytes)"
echo "== each hospital: what crossed its link (its own wire log), and its trained model on images it has"
(cd "$WORK/st_marys" && fedsilo site audit)
# its export's files as they are (DICOMs without a suffix, PNGs), harmonized as its training images were
(cd "$WORK/st_marys" && fedsilo site predict --experiment site --images data/raw/st_marys/export --out predictions.csv)
head -4 "$WORK/st_marys/predictions.csv"
echo "== St Marys validates its model on a later labelled export it never trained on"
(cd "$WORK/st_marys" && fedsilo -q fetch --source st_marys_later && fedsilo -q harmonize --dataset external \
   && fedsilo site evaluate --dataset external --bootstrap 500)
echo "each site's stores and model: $WORK/<site>/state/deploy/loopback_three_hospitals/"
