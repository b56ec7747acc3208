"""The Gluon attention kernels for Hopper (warp-specialised: a TMA producer warp, wgmma consumer
warpgroups, and in the backward a dQ writer): ``forward`` (head dims 64, 128, 256), ``backward``
(64, 128), ``backward_hd256`` and ``backward_launch``, the two backward kernels' host side. Gluon
has no interpreter: these modules import only with Triton's interpreter off, and the launchers
route to them only on a Hopper GPU."""
