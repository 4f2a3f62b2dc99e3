"""One run of the chart's scheduled tenant backup (controlPlane.backup), the CronJob's command.

`kvfence tenants backup` writes BACKUP_DIR/tenants-<UTC time>.backup: a consistent snapshot over
the admin API at KVFENCE_ADMIN_TARGET, with the token of ADMIN_TOKEN_FILE (passed in the
environment, not on a command line that ps shows), verifying the endpoint's certificate against
ADMIN_TLS_CA when that is set, and that it names ADMIN_TLS_SERVER_NAME (`--tls-server-name`: the
name the nodes reach the control plane by, not the admin Service's) when that is set too. Then
every file of that name pattern but the newest BACKUP_KEEP is deleted; other files in BACKUP_DIR
are left alone. A failed backup deletes nothing and exits non-zero, so the Job fails (alert on
that); so does a backup whose old files could not be deleted.

Python, not sh: the kvfence image has Python and the kvfence CLI, nothing else is promised.
templates/tenant-backup.yaml renders it into the CronJob; tests/helm/test_chart_backup.py runs it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

# What this job writes; names sort by time. A file named otherwise (a hand-made backup) is never
# counted or deleted.
BACKUP_NAME = re.compile(r"tenants-\d{8}T\d{6}Z\.backup")
# The file `kvfence tenants backup` writes before it renames it (".NAME.PID.tmp"). A run killed
# on its deadline leaves one; runs never overlap (concurrencyPolicy: Forbid), so one older than
# STALE_TMP_S is no live run's.
TMP_NAME = re.compile(r"\.tenants-\d{8}T\d{6}Z\.backup\.\d+\.tmp")
STALE_TMP_S = 3600.0


def log(message: str) -> None:
    print(f"tenant-backup: {message}", file=sys.stderr, flush=True)


def main() -> int:
    out_dir = Path(os.environ["BACKUP_DIR"])
    keep = int(os.environ["BACKUP_KEEP"])
    if keep < 1:
        log(f"BACKUP_KEEP is {keep}: it must keep at least the backup it takes")
        return 2
    try:
        token = Path(os.environ["ADMIN_TOKEN_FILE"]).read_text().strip()
    except OSError as err:
        log(f"FAILED: cannot read the admin token: {err}")
        return 1
    for p in out_dir.iterdir():
        try:  # tidying only: whatever goes wrong here must not cost the backup
            if TMP_NAME.fullmatch(p.name) and time.time() - p.stat().st_mtime > STALE_TMP_S:
                p.unlink(missing_ok=True)
                log(f"deleted {p.name}, left by a run that was killed")
        except OSError as err:
            log(f"cannot delete {p.name}: {err}")
    out = out_dir / time.strftime("tenants-%Y%m%dT%H%M%SZ.backup", time.gmtime())
    cmd = ["kvfence", "tenants", "backup", str(out)]
    cmd += ["--timeout", os.environ.get("BACKUP_TIMEOUT_S", "120")]
    if os.environ.get("ADMIN_TLS_CA"):
        cmd += ["--tls-ca", os.environ["ADMIN_TLS_CA"]]
        if os.environ.get("ADMIN_TLS_SERVER_NAME"):
            cmd += ["--tls-server-name", os.environ["ADMIN_TLS_SERVER_NAME"]]
    status = subprocess.run(cmd, env={**os.environ, "KVFENCE_ADMIN_TOKEN": token}).returncode
    if status != 0 or not out.is_file():
        log(f"FAILED (kvfence exit status {status}): no new backup; no old one deleted")
        return status or 1
    # The new backup counts as the newest whatever the others' names say (a clock set back).
    others = sorted(
        p.name for p in out_dir.iterdir() if BACKUP_NAME.fullmatch(p.name) and p.name != out.name
    )
    doomed = others[: max(len(others) - (keep - 1), 0)]
    failed = False
    for name in doomed:
        try:
            (out_dir / name).unlink()
        except FileNotFoundError:
            pass
        except OSError as err:
            log(f"cannot delete the old backup {name}: {err}")
            failed = True
        else:
            log(f"deleted the old backup {name}")
    log(f"backed up to {out}; {len(others) - len(doomed) + 1} backups kept (keep: {keep})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
