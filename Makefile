# Both entry points do all of their own set-up on a fresh Debian 12 machine (as root):
# system packages, the virtualenv, the package itself and the default image.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DATA_DIR ?= /var/lib/branchbox
# libnftables1: the sandbox firewall (runtime.nft loads it with ctypes).
APT_PACKAGES := debootstrap btrfs-progs gcc libc6-dev libnftables1
# The /ui page's tests drive Debian's headless Chromium through its chromedriver; the
# host-disk tests make a small ext4 filesystem (mkfs.ext4) to stand in for a full host disk;
# the speculate tests' candidates run pytest and httpx of the host's own python (image "host").
TEST_APT_PACKAGES := chromium chromium-driver e2fsprogs openssl python3-pytest python3-httpx

.PHONY: run test soak system-deps test-deps image lint bench

# $(call apt_install,PACKAGES): install those not installed yet.
apt_install = @dpkg -s $(1) >/dev/null 2>&1 || \
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(1))

system-deps:
	$(call apt_install,$(APT_PACKAGES))

test-deps:
	$(call apt_install,$(TEST_APT_PACKAGES))

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

image: system-deps $(VENV)/.installed
	$(PY) -c "from branchbox.storage.images import ensure_image; ensure_image()"

run: image
	$(PY) -m branchbox serve --data-dir $(DATA_DIR)

test: image test-deps
	$(VENV)/bin/ruff check src tests benchmarks
	$(PY) -m pytest -q -p no:cacheprovider

# 10,000 fork -> merge rounds against a served daemon (10-20 minutes on 2 vCPU).
soak: image
	$(PY) -m pytest -q -p no:cacheprovider -m soak tests/test_soak.py

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

# The README's table and chart come from this run (about 5 minutes on 2 vCPU).
bench: image
	$(PY) -m branchbox bench --json bench-results/bench.json --plot docs/bench.png
