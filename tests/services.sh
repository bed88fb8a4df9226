#!/usr/bin/env bash
# Starts the servers the tests need when they are not already reachable on 127.0.0.1,
# installing them from Debian's packages when they are missing (needs root, as in CI).
set -euo pipefail

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
apt_updated=0
need_package() {
  dpkg -s "$1" >/dev/null 2>&1 && return 0
  if [ "$apt_updated" = 0 ]; then as_root apt-get update -qq; apt_updated=1; fi
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "$1" >/dev/null
}
wait_for() { for _ in $(seq 1 50); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done; "$@"; }

if ! (command -v redis-cli >/dev/null && redis-cli -h 127.0.0.1 ping >/dev/null 2>&1); then
  echo "starting redis-server"
  need_package redis-server
  as_root mkdir -p /var/lib/redis /var/log/redis
  as_root redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" \
    --appendonly no --dir /var/lib/redis --logfile /var/log/redis/ci.log
  wait_for redis-cli -h 127.0.0.1 ping
fi

if ! (command -v pg_isready >/dev/null && pg_isready -q -h 127.0.0.1 -p 5432); then
  echo "starting postgresql"
  need_package postgresql
  version=$(ls /etc/postgresql | sort -V | tail -n 1)
  conf=/etc/postgresql/$version/main
  if ! as_root grep -q "aio-keuss" "$conf/pg_hba.conf"; then
    as_root sed -i '1i host all all 127.0.0.1/32 trust # aio-keuss tests\nhost all all ::1/128 trust # aio-keuss tests\nlocal all all trust # aio-keuss tests' "$conf/pg_hba.conf"
  fi
  as_root pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
  wait_for pg_isready -h 127.0.0.1 -p 5432
fi
if ! psql -h 127.0.0.1 -U postgres -d test -c "select 1" >/dev/null 2>&1; then
  psql -h 127.0.0.1 -U postgres -c "create database test" >/dev/null
fi
# Each test makes and drops a schema of its own. With autovacuum off (as this machine kind's
# server runs), the system catalogs keep every dropped table's rows (600,000 dead rows in
# pg_attribute after a few runs of the suite) and each later DDL statement walks them: a
# VACUUM of the test database first, about a second.
if [ "$(psql -h 127.0.0.1 -U postgres -d test -tAc 'show autovacuum' 2>/dev/null)" = "off" ]; then
  psql -h 127.0.0.1 -U postgres -d test -qc "VACUUM" >/dev/null || true
fi

# Locale sources for the test that runs a Redis under a collating locale: it compiles
# en_US.UTF-8 into a temporary directory with localedef (glibc's) from them.
if ! [ -d /usr/share/i18n/locales ]; then
  echo "installing locales"
  need_package locales
fi

# Java for the Spark tests (pyspark runs a JVM); Debian's headless JRE is enough.
if ! command -v java >/dev/null 2>&1; then
  echo "installing java"
  need_package default-jre-headless
fi

# Chromium for the dashboard's browser tests: Playwright drives Debian's build
# (/usr/bin/chromium), so nothing is downloaded by `playwright install`.
if ! [ -x /usr/bin/chromium ]; then
  echo "installing chromium"
  need_package chromium
fi
