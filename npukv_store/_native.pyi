ABI_VERSION: int
_GIL_MINSIZE: int
SYNC_FILE_RANGE_WAIT_BEFORE: int
SYNC_FILE_RANGE_WRITE: int
SYNC_FILE_RANGE_WAIT_AFTER: int

def sync_file_range(fd: int, offset: int, nbytes: int, flags: int = ..., /) -> None: ...

# checksum.c (present when built with the xxhash header)
def xxh3_rows(parts: object, nrows: int, /) -> bytes: ...
