#!/bin/sh
# The serving image's entrypoint: `tuner serve` with the arguments it is given (KServe's
# manifest passes the artifact's folder and the ports), or, when the container is started
# the way Amazon SageMaker starts one (`docker run IMAGE serve`), `tuner serve` on
# SageMaker's terms: the artifact where SageMaker puts the model (/opt/ml/model, or
# SM_MODEL_DIR), HTTP on the port SageMaker sends to (8080, or SAGEMAKER_BIND_TO_PORT), where
# /ping and /invocations answer. SageMaker passes settings only as environment variables:
# each SM_TUNER_<OPTION>=<value> becomes `--<option> <value>` (SM_TUNER_MAX_STREAMS=8:
# --max-streams 8; the value `true` gives the bare flag, e.g. SM_TUNER_SPIN=true: --spin).
# Arguments after `serve` come last (the tests bind 127.0.0.1 and free ports that way).
set -eu

if [ "${1:-}" != serve ]; then
    exec tuner serve "$@"
fi
shift
extra=""
for name in $(env | sed -n 's/^SM_TUNER_\([A-Z0-9_]*\)=.*/\1/p' | sort); do
    value=$(printenv "SM_TUNER_${name}")
    flag="--$(printf '%s' "$name" | tr 'A-Z_' 'a-z-')"
    if [ "$value" = true ]; then
        extra="$extra $flag"
    else
        extra="$extra $flag $value"
    fi
done
# (word splitting of $extra is meant: an option's value has no spaces)
# shellcheck disable=SC2086
exec tuner serve "${SM_MODEL_DIR:-/opt/ml/model}" --host 0.0.0.0 \
    --http-port "${SAGEMAKER_BIND_TO_PORT:-8080}" $extra "$@"
