"""The channel: what the kernel and its workers say to each other, and how it travels.

``_messages`` (one frozen dataclass per message), ``_wire`` (frames on a Unix socket,
CPU-only pickling), ``_jobs`` (the table of job kinds a worker runs), ``_cluster_wire`` (the
authenticated TCP transport to a rank on another machine) and ``_rendezvous`` (the ranks'
own meeting point, torch's TCPStore on loopback). Nothing here starts or supervises a
process; everything above imports it.
"""
