"""The Ray cluster start backend: ranks placed on a cluster's nodes, supervised from here.

``_cluster`` (place, start, and stand for remote ranks), ``_cluster_place`` (reach the
cluster, reserve its nodes) and ``_cluster_host`` (the actor that runs on a node). Ray is
imported lazily, only when a launch names a cluster.
"""
