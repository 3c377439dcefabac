"""The Gluon kernels: warp-specialised sm90 forward, dK/dV and dQ (Triton 3.6's Gluon API).

route.py decides which calls they serve (importable without Gluon); launch.py launches them."""
