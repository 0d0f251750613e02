package image

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"debug/elf"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// What the test stamps into the image, so every check can be exact.
const (
	ref     = "localhost/kvbandit-imagetest:test"
	version = "v0.0.0-imagetest"
	commit  = "0123456789abcdef0123456789abcdef01234567"
	date    = "2026-01-02T03:04:05Z"
)

// store is a private containers-storage (vfs: plain directories, no
// mounts) shared by buildah and podman, removed with the test's temp dir.
type store struct{ root, runroot, tmp string }

func newStore(t *testing.T) store {
	d := t.TempDir()
	s := store{filepath.Join(d, "root"), filepath.Join(d, "run"), filepath.Join(d, "tmp")}
	t.Cleanup(func() {
		// Nothing of the store may stay mounted once the test is done.
		mi, err := os.ReadFile("/proc/self/mountinfo")
		if err == nil && bytes.Contains(mi, []byte(d)) {
			t.Errorf("still mounted under %s:\n%s", d, mi)
		}
	})
	return s
}

func (s store) buildahFlags() []string {
	return []string{"--root", s.root, "--runroot", s.runroot, "--storage-driver", "vfs"}
}

// podman runs containers with runc and cgroupfs: crun 1.8 refuses a
// cgroup v1/v2 hybrid host (as CI sandboxes often are) and no systemd is
// there to manage cgroups.
func (s store) podman(args ...string) []string {
	return append([]string{"podman", "--root", s.root, "--runroot", s.runroot, "--storage-driver", "vfs", "--tmpdir", s.tmp,
		"--runtime", "runc", "--cgroup-manager", "cgroupfs", "--events-backend", "none"}, args...)
}

// runFlags are podman run's flags for every container. Podman as root
// raises RLIMIT_NOFILE and RLIMIT_NPROC to 1048576 by default, which needs
// CAP_SYS_RESOURCE; an unprivileged CI sandbox lacks it, so the limits are
// set at or below ours.
func runFlags(t *testing.T) []string {
	var fl []string
	for _, l := range []struct {
		name     string
		resource int
	}{{"nofile", syscall.RLIMIT_NOFILE}, {"nproc", 6 /* RLIMIT_NPROC on every architecture the image is built for */}} {
		var r syscall.Rlimit
		if err := syscall.Getrlimit(l.resource, &r); err != nil {
			t.Fatal(err)
		}
		n := min(r.Cur, 4096)
		fl = append(fl, "--ulimit", fmt.Sprintf("%s=%d:%d", l.name, n, n))
	}
	return fl
}

// run runs a command and returns its stdout; it fails the test with the
// command's stderr when the command fails.
func run(t *testing.T, ctx context.Context, dir string, argv ...string) string {
	t.Helper()
	out, err := runErr(ctx, dir, argv...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func runErr(ctx context.Context, dir string, argv ...string) (string, error) {
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	cmd.Dir = dir
	// The make that runs `make test` must not hand its jobserver or its
	// variables to the make the test runs.
	cmd.Env = slices.DeleteFunc(os.Environ(), func(kv string) bool {
		return strings.HasPrefix(kv, "MAKEFLAGS=") || strings.HasPrefix(kv, "MFLAGS=") || strings.HasPrefix(kv, "MAKELEVEL=")
	})
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return stdout.String(), fmt.Errorf("%s: %w\n%s%s", strings.Join(argv, " "), err, stdout.Bytes(), stderr.Bytes())
	}
	return stdout.String(), nil
}

// TestImage builds the image with `make image` (buildah, offline, FROM
// scratch), checks its configuration, labels and contents, then runs it
// with podman: `version` and `--version` print the stamped build, and
// `serve` answers gRPC health and /metrics probed from outside the
// container, runs as 65532, and exits 0 on podman stop (SIGTERM).
func TestImage(t *testing.T) {
	for _, tool := range []string{"make", "buildah", "podman", "runc"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s is needed (Debian: apt-get install buildah podman runc): %v", tool, err)
		}
	}
	// A cold build cache makes the static compile the slow part (minutes);
	// make e2e gives the package 15.
	ctx, cancel := context.WithTimeout(t.Context(), 14*time.Minute)
	defer cancel()
	root, err := repoRoot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	s := newStore(t)

	// The build: make compiles the static binary, then buildah builds the
	// image in the private store.
	run(t, ctx, root, "make", "--no-print-directory", "image",
		"VERSION="+version, "COMMIT="+commit, "DATE="+date,
		"IMAGE="+strings.TrimSuffix(ref, ":test"), "IMAGE_TAG=test",
		"BUILDAH_FLAGS="+strings.Join(s.buildahFlags(), " "))
	t.Cleanup(func() {
		if _, err := runErr(context.Background(), root, s.podman("rmi", "-a", "-f")...); err != nil {
			t.Errorf("removing the images: %v", err)
		}
	})

	t.Run("config", func(t *testing.T) {
		out := run(t, ctx, root, append(append([]string{"buildah"}, s.buildahFlags()...), "inspect", "--type", "image", ref)...)
		var img struct {
			OCIv1 struct {
				Architecture string `json:"architecture"`
				OS           string `json:"os"`
				Config       struct {
					User         string              `json:"User"`
					Entrypoint   []string            `json:"Entrypoint"`
					Cmd          []string            `json:"Cmd"`
					ExposedPorts map[string]struct{} `json:"ExposedPorts"`
					Labels       map[string]string   `json:"Labels"`
				} `json:"config"`
			}
		}
		if err := json.Unmarshal([]byte(out), &img); err != nil {
			t.Fatal(err)
		}
		c := img.OCIv1.Config
		if c.User != "65532:65532" || !slices.Equal(c.Entrypoint, []string{"/kvbandit"}) || !slices.Equal(c.Cmd, []string{"help"}) || img.OCIv1.OS != "linux" {
			t.Fatalf("config %+v", img.OCIv1)
		}
		for _, p := range []string{"9002/tcp", "9003/tcp", "9090/tcp"} {
			if _, ok := c.ExposedPorts[p]; !ok {
				t.Errorf("port %s not exposed: %v", p, c.ExposedPorts)
			}
		}
		want := map[string]string{
			"org.opencontainers.image.version":  version,
			"org.opencontainers.image.revision": commit,
			"org.opencontainers.image.created":  date,
			"org.opencontainers.image.source":   "https://github.com/kvbandit/kvbandit",
		}
		for k, v := range want {
			if c.Labels[k] != v {
				t.Errorf("label %s = %q, want %q", k, c.Labels[k], v)
			}
		}
	})

	t.Run("contents", func(t *testing.T) {
		// Push it to a directory (what `buildah push … docker://` sends to
		// a registry) and read its layers: the binary and the CA bundle,
		// nothing else; the binary is static (no ELF interpreter).
		dir := filepath.Join(t.TempDir(), "pushed")
		run(t, ctx, root, append(append([]string{"buildah"}, s.buildahFlags()...), "push", "--disable-compression", ref, "dir:"+dir)...)
		files, bin := layerFiles(t, dir)
		if !slices.Equal(files, []string{"etc/ssl/certs/ca-certificates.crt", "kvbandit"}) {
			t.Fatalf("the image holds %v, want only the CA bundle and the binary", files)
		}
		f, err := elf.Open(bin)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		for _, p := range f.Progs {
			if p.Type == elf.PT_INTERP {
				t.Fatal("the binary is dynamically linked (it has an ELF interpreter)")
			}
		}
	})

	t.Run("version", func(t *testing.T) {
		want := "kvbandit " + version + "\ncommit: " + commit + "\nbuilt:  " + date + "\ngo:     go"
		for _, arg := range []string{"version", "--version"} {
			out := run(t, ctx, root, s.podman(append(append([]string{"run", "--rm", "--network", "none"}, runFlags(t)...), ref, arg)...)...)
			if !strings.HasPrefix(out, want) || !strings.HasSuffix(out, " linux/"+goarch(t, ctx, root)+"\n") {
				t.Errorf("%s printed %q, want %q…", arg, out, want)
			}
		}
	})

	t.Run("serve", func(t *testing.T) {
		// The container shares the test's network namespace (host network),
		// binds loopback only, and is probed from here.
		grpcAddr, healthAddr, metricsAddr, worker := freeAddr(t), freeAddr(t), freeAddr(t), freeAddr(t)
		name := fmt.Sprintf("kvbandit-imagetest-%d", os.Getpid())
		args := append(append([]string{"run", "-d", "--name", name, "--network", "host"}, runFlags(t)...), ref,
			"serve", "--grpc-addr", grpcAddr, "--health-addr", healthAddr, "--metrics-addr", metricsAddr,
			"--endpoints", worker, "--policy", "round_robin")
		run(t, ctx, root, s.podman(args...)...)
		t.Cleanup(func() {
			if _, err := runErr(context.Background(), root, s.podman("rm", "-f", "-t", "0", name)...); err != nil {
				t.Errorf("removing the container: %v", err)
			}
		})
		// podman logs replays the container's stdout and stderr (where serve
		// logs) on its own.
		logs := func() string {
			argv := s.podman("logs", name)
			out, _ := exec.CommandContext(ctx, argv[0], argv[1:]...).CombinedOutput()
			return string(out)
		}

		conn, err := grpc.NewClient(healthAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		hc := healthpb.NewHealthClient(conn)
		for _, svc := range []string{"liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"} {
			if err := waitServing(ctx, hc, svc); err != nil {
				t.Fatalf("%s: %v\nlogs:\n%s", svc, err, logs())
			}
		}
		metrics, err := get(ctx, "http://"+metricsAddr+"/metrics")
		if err != nil {
			t.Fatal(err)
		}
		buildInfo := fmt.Sprintf(`kvbandit_build_info{commit=%q,date=%q,goversion="go`, commit, date)
		if !strings.Contains(metrics, buildInfo) || !strings.Contains(metrics, fmt.Sprintf(`version=%q} 1`, version)) {
			t.Errorf("/metrics lacks %s…,version=%q} 1", buildInfo, version)
		}

		// The process runs as the image's user, seen from the host.
		pid := strings.TrimSpace(run(t, ctx, root, s.podman("inspect", "--format", "{{.State.Pid}}", name)...))
		status, err := os.ReadFile("/proc/" + pid + "/status")
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(string(status), "\nUid:\t65532\t65532\t65532\t65532\n") {
			t.Errorf("container process %s is not user 65532:\n%s", pid, status)
		}

		// podman stop sends SIGTERM: serve drains and exits 0.
		run(t, ctx, root, s.podman("stop", "-t", "30", name)...)
		code := strings.TrimSpace(run(t, ctx, root, s.podman("inspect", "--format", "{{.State.ExitCode}}", name)...))
		out := logs()
		if code != "0" {
			t.Errorf("exit code %s after podman stop, want 0; logs:\n%s", code, out)
		}
		if !strings.Contains(out, `msg="kvbandit serving" version=`+version+" commit="+commit+" built="+date) {
			t.Errorf("the start-up line lacks the build:\n%s", out)
		}
	})
}

func repoRoot(ctx context.Context) (string, error) {
	out, err := exec.CommandContext(ctx, "go", "env", "GOMOD").Output()
	if err != nil {
		return "", fmt.Errorf("go env GOMOD: %w", err)
	}
	return filepath.Dir(strings.TrimSpace(string(out))), nil
}

func goarch(t *testing.T, ctx context.Context, root string) string {
	return strings.TrimSpace(run(t, ctx, root, "go", "env", "GOARCH"))
}

// layerFiles reads an image pushed to a dir: transport (manifest.json and
// one file per blob, named by its hex digest) and returns the regular files
// of its layers, sorted, and the path of a copy of /kvbandit.
func layerFiles(t *testing.T, dir string) ([]string, string) {
	t.Helper()
	mb, err := os.ReadFile(filepath.Join(dir, "manifest.json"))
	if err != nil {
		t.Fatal(err)
	}
	var man struct {
		Layers []struct {
			MediaType string `json:"mediaType"`
			Digest    string `json:"digest"`
		} `json:"layers"`
	}
	if err := json.Unmarshal(mb, &man); err != nil || len(man.Layers) == 0 {
		t.Fatalf("manifest.json %s: %v", mb, err)
	}
	var files []string
	bin := filepath.Join(t.TempDir(), "kvbandit")
	for _, l := range man.Layers {
		f, err := os.Open(filepath.Join(dir, strings.TrimPrefix(l.Digest, "sha256:")))
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		var r io.Reader = bufio.NewReaderSize(f, 1<<20)
		if strings.HasSuffix(l.MediaType, "gzip") {
			zr, err := gzip.NewReader(r)
			if err != nil {
				t.Fatal(err)
			}
			r = zr
		}
		lr := tar.NewReader(r)
		for {
			h, err := lr.Next()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				t.Fatalf("layer %s: %v", l.Digest, err)
			}
			if h.Typeflag == tar.TypeDir {
				continue
			}
			name := strings.TrimPrefix(h.Name, "./")
			files = append(files, name)
			if name != "kvbandit" {
				continue
			}
			if h.Mode&0o111 == 0 {
				t.Errorf("/kvbandit mode %o is not executable", h.Mode)
			}
			out, err := os.Create(bin)
			if err != nil {
				t.Fatal(err)
			}
			_, err = io.Copy(out, lr)
			if cerr := out.Close(); err == nil {
				err = cerr
			}
			if err != nil {
				t.Fatal(err)
			}
		}
	}
	slices.Sort(files)
	return files, bin
}

// freeAddr returns a loopback address that was free a moment ago.
func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// waitServing polls a gRPC health service for up to 30 s.
func waitServing(ctx context.Context, hc healthpb.HealthClient, svc string) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for {
		cctx, ccancel := context.WithTimeout(ctx, time.Second)
		r, err := hc.Check(cctx, &healthpb.HealthCheckRequest{Service: svc})
		ccancel()
		if err == nil && r.GetStatus() == healthpb.HealthCheckResponse_SERVING {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("not SERVING after 30 s: %v %v", r, err)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func get(ctx context.Context, url string) (string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return "", err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 4<<20))
	if err != nil {
		return "", err
	}
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	return string(b), nil
}
