"""What crosses between processes: the job's store and its protocol, gradient sync, state transfer.

Built on torch.distributed (TCPStore, process groups); used by the worker
and the driver, never the reverse.
"""
