"""What every command of the project shares, in the standard library only: argument parsing that never drops a
flag given twice (:mod:`.flags`), the files a command reads (:mod:`.input_files`: regular files of bounded size) and
the files it writes (:mod:`.output_files`: never a checkpoint's, an input's or a device's file; written atomically).

``unicache_core``'s commands (``python -m unicache_core.bagel``, ``.calibrate``, ``python -m training``) and the batch
runner (``python -m tools.batch``, which runs without torch or the library) import it; it imports nothing of the
project. Importing it has no side effects.
"""
