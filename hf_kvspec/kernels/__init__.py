"""CPU kernels for decoding: ``linear.py`` (the ``DecodeKernels`` context) routes few-row ``nn.Linear`` calls
through the fastest of the kernels in ``ops.py``, chosen by timing real calls (``trials.py``), reading weight
copies kept in ``copies.py``. ``quantized.py``: weight-only int8/int4 linear (``qlinear``) on a C kernel
(``qgemv.c``) compiled once per machine by ``build.py``."""
