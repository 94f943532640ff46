# Sourced by the checks for a one-GPU machine (scripts/check_gpu.sh, scripts/check_gpu_scale.sh):
# that machine has torch and transformers but none of rlorch's other dependencies and no network,
# so they travel as wheels in .gpu-wheels/ (git-ignored), made here by scripts/gpu_wheels.sh; the
# device run names .gpu-wheels in `carry`. check_wheels proves them complete and small enough to
# travel; install_rlorch installs them and rlorch (or puts both on PYTHONPATH).
wheels=.gpu-wheels
packages=(hydra-core omegaconf antlr4-python3-runtime orjson pysimdjson)
limit_mib=64

check_wheels() {
    local missing=0 name file
    for name in "${packages[@]}"; do
        file=$(ls "$wheels"/"${name//-/_}"-*.whl 2>/dev/null | head -1 || true)
        if [[ -z $file ]]; then echo "wheels: $name missing from $wheels/"; missing=1; else echo "wheels: $(basename "$file")"; fi
    done
    [[ $missing == 0 ]] || { echo "FAIL: make them with: bash scripts/gpu_wheels.sh"; exit 1; }
    local kib
    kib=$(du -sk "$wheels" | cut -f1)
    echo "wheels: $kib KiB in all (limit $limit_mib MiB a device call, the whole tree included)"
    (( kib < limit_mib * 1024 )) || { echo "FAIL: $wheels is over $limit_mib MiB"; exit 1; }
    # Each resolves, from the folder alone, for the GPU machine's CPython 3.12 on x86-64.
    python3 -m pip install -q --dry-run --no-index --no-deps --find-links "$wheels" --only-binary=:all: \
        --python-version 3.12 --implementation cp --platform manylinux_2_17_x86_64 \
        --target "$(mktemp -d)" "${packages[@]}"
    echo "wheels: all resolve for cp312 x86-64"
}

install_rlorch() {
    if ! python3 -m pip install -q --no-index --find-links "$wheels" "${packages[@]}"; then
        local site
        site=$(mktemp -d)
        python3 -m pip install -q --no-index --no-deps --target "$site" "$wheels"/*.whl
        export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
    fi
    python3 -m pip install -q --no-deps --no-build-isolation -e . \
        || echo "editable install failed: rlorch runs from the checkout (PYTHONPATH)"
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    python3 -c 'import rlorch, rlorch.trainer.fsdp, rlorch.config.compose, torch, transformers
print("rlorch from", rlorch.__path__[0], "| torch", torch.__version__, "| transformers", transformers.__version__)'
}

