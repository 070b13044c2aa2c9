"""Small shared helpers below every room.

- ``paths``: the cache folder, package folders, file digests, atomic writes (every file oakenkv writes), and the
  checks of every file it reads (a regular file under a size cap, read at most that much).
- ``exact``: exact types for what comes from files and the environment (a bool is not an int, numbers bounded).
- ``text``: the one sanitizer of text from files before it is printed (escapes visible, rich markup escaped).
- ``resources``: the memory a job needs against what the machine has, checked before work.
- ``compat``: differences between the transformers versions supported (which keyword takes a cache).
"""
