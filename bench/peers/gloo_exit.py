"""How a process that used a Gloo process group ends.

After a collective completes, Gloo's worker thread still drops its own reference to the work and
with it the work's tensors; for tensors that are Python objects that drop takes the GIL. When the
interpreter is finalizing by then, the thread is ended inside a noexcept destructor and the whole
process aborts ("terminate called without an active exception" after everything it had to print;
pytorch/pytorch#179291). A peer that has written everything it reports therefore ends without
interpreter finalization: streams flushed, then os._exit.
"""
import os
import sys


def leave(code=0):
    """Flushes stdout and stderr and ends the process with `code`; never returns."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
