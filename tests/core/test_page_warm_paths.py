"""core/page_warm.paths_of against indexes built by tools/builder.py (canonical: inode numbers
depth-first pre-order): every wanted inode is found at a path that names it, however the
wanted set is drawn, hardlinks (also between folders) and deep folders included; what is not
wanted is left out."""

from __future__ import annotations

import random

from support.trees import dir, file, hardlink  # noqa: A004

from weenvfs.core.page_warm import paths_of


def test_paths_of_finds_every_wanted_file(repo, build_group) -> None:
    rng = random.Random(4)
    specs = [dir("a/b/c"), dir("z")]
    specs += [file(f"{folder}/f{n:02d}", rng.randbytes(rng.randrange(1, 300)))
              for folder in ("a", "a/b", "a/b/c", "z", "m/n/o/p") for n in range(12)]
    # Hardlinks to files met earlier are numbered below the entries around them: "b-link"
    # sits between folder "a" and "m" at the top and must not cut a's subtree short.
    specs += [hardlink("z/linked", "a/b/f03"), hardlink("b-link", "a/b/c/f07"),
              file("top", b"t")]
    index = build_group(repo, specs).index
    regular = sorted({ino for _, ino in index.walk() if index.inode(ino).is_reg})
    for size in (1, 5, len(regular) // 2, len(regular)):
        wanted = set(rng.sample(regular, size))
        found = paths_of(index, wanted)
        assert set(found) == wanted, size
        assert all(index.resolve(path) == ino for ino, path in found.items())
    assert paths_of(index, set()) == {}
