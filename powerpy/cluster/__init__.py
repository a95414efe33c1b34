"""Beyond one machine: a model split by layer range into pipeline stages, and server replicas.

- ``stage``: one stage (layers [first, end) of a model, its KV caches, the last stage's
  samplers), in any process;
- ``pipeline``: :class:`PipelineEngine`, the scheduler's engine over stages, with deadlines,
  failure and restart handling;
- ``actors``: the stages as Ray actors pinned to nodes (``pip install 'powerpy[cluster]'``);
- ``plan``: which layers go to which node (``powerpy plan``, ``--pipeline auto``);
- ``replicas``: ``powerpy serve --replicas``, the server as a Ray Serve deployment.

Nothing here imports Ray until a pipeline or replicas are started over Ray.
"""
