"""Small shared helpers below every room.

- ``paths``: the cache folder, package folders, file digests, atomic writes (every file oakenkv writes).
- ``resources``: the memory a job needs against what the machine has, checked before work.
- ``compat``: differences between the transformers versions supported (which keyword takes a cache).
"""
