# The cluster image: Ray's CUDA image with the project and its `gpu` extra (vLLM's CUDA build and the
# torch it wants), every pin from pyproject.toml. cluster.yaml and k8s/rayjob.yaml run it.
#
#   docker build -t REGISTRY/dflash-ray:0.1.0 . && docker push REGISTRY/dflash-ray:0.1.0
#
# The tag follows pyproject.toml's version. Ray in the base matches the project's `ray` pin.
FROM rayproject/ray:2.60.0-py311-cu128

# NCCL between nodes on AWS: the EFA user-space stack (libfabric) and NCCL's OFI plugin, which the
# EFA installer carries (under /opt/amazon/ofi-nccl); the kernel driver is the host's. Set the version
# to the installer your GPU AMI's EFA driver comes with. Without it NCCL falls back to sockets, which
# `dflash-ray netcheck` shows (a node pair at a few GB/s) and `train.min_bus_bandwidth` refuses.
ARG EFA_INSTALLER_VERSION=1.43.1
USER root
RUN cd /tmp && curl -fsSLO https://efa-installer.amazonaws.com/aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz \
 && tar -xf aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz && cd aws-efa-installer \
 && ./efa_installer.sh -y --skip-kmod --skip-limit-conf --no-verify \
 && cd / && rm -rf /tmp/aws-efa-installer* && ldconfig
USER ray
ENV LD_LIBRARY_PATH=/opt/amazon/ofi-nccl/lib:/opt/amazon/efa/lib:${LD_LIBRARY_PATH} \
    FI_PROVIDER=efa FI_EFA_USE_DEVICE_RDMA=1

WORKDIR /home/ray/dflash-ray
COPY --chown=ray:users pyproject.toml README.md ./
COPY --chown=ray:users tools/ tools/
COPY --chown=ray:users dflash_ray/ dflash_ray/
COPY --chown=ray:users kernels/ kernels/
COPY --chown=ray:users jobs/ jobs/
COPY --chown=ray:users configs/ configs/
RUN pip install --no-cache-dir ".[gpu,track]" \
 && pip install --no-cache-dir --no-deps $(python tools/pins.py no-deps)
