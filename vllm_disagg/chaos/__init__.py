"""``vllm-disagg chaos``: a simulated cluster under streaming load while engines and agents are killed.

``load`` sends bounded traffic, ``check`` judges every response byte for byte, ``killer`` injects the
faults and watches the victims come back, ``report`` adds it up; ``cli`` ties them together. With
``--replicas N``: ``etcd`` starts a throwaway etcd, ``replicas`` runs N orchestrator replicas on it (and
kills them), and ``spread`` spreads the load over them as a load balancer would.
"""
