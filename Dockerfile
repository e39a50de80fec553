# The cluster image: Ray's CUDA image with the project and its `gpu` extra (vLLM's CUDA build and the
# torch it wants), every pin from pyproject.toml. cluster.yaml and k8s/rayjob.yaml run it.
#
#   docker build -t REGISTRY/dflash-ray:0.1.0 . && docker push REGISTRY/dflash-ray:0.1.0
#
# The tag follows pyproject.toml's version. Ray in the base matches the project's `ray` pin.
FROM rayproject/ray:2.60.0-py311-cu128

WORKDIR /home/ray/dflash-ray
COPY --chown=ray:users pyproject.toml README.md ./
COPY --chown=ray:users tools/ tools/
COPY --chown=ray:users dflash_ray/ dflash_ray/
COPY --chown=ray:users kernels/ kernels/
COPY --chown=ray:users jobs/ jobs/
COPY --chown=ray:users configs/ configs/
RUN pip install --no-cache-dir ".[gpu,track]" \
 && pip install --no-cache-dir --no-deps $(python tools/pins.py no-deps)
