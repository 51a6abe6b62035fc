"""One process-wide lock for MindSpore's graph compiler and executor, shared by the `ms` backend and export.

MindSpore's graph compiler is not thread-safe: a compile in the generator's idle warm-up thread running beside
another compile or an export in the same process crashed it ("Illegal AnfNode for evaluating"). Every compile and
run of the `ms` backend, and every graph export, holds this lock. It lives apart from both so that neither imports
the other (export may import lite_runtime's contract modules and this one, never a backend).
"""
import threading

MINDSPORE_LOCK = threading.RLock()
