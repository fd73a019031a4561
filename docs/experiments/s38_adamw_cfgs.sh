# session 38: the in-backward AdamW dW GEMMs under ping-pong / prefetch configs (coda.bench.optim), H100
source .device/cutlass-dsl-4.8.1/setup.sh; python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
export CODA_AUTOTUNE=0
timeout 560 python -m coda.bench.optim --configs 64,256,pp,1,static,32,- 64,256,pp,2,static,32,- 128,192,pp,2,static,16,- 128,128,pp,2,static,32,- 128,256,coop,2,static,32,-,pf4 128,256,coop,2,static,32,-,ewg,pf4 2>&1 | grep -v -i warn
