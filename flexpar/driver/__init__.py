"""The driver: the process that called `fit()` (or `flexpar join` on another host).

It checks the job, hosts the store and the coordinator, starts worker
processes from a fork server, and relays the workers' records to the
metrics file, the display and the callbacks.
"""
