"""The Gluon attention kernels for Hopper (warp-specialised: a TMA producer warp, wgmma consumer
warpgroups, and in the backward a dQ writer). ``forward`` (head dims 64, 128, 256),
``backward`` (64, 128) and ``backward_hd256``. Gluon has no interpreter: these modules import
only with Triton's interpreter off, and the launchers route to them only on a Hopper GPU."""
