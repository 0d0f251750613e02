// Package kubeenv runs a real Kubernetes API server for tests: kube-apiserver
// v1.36.3 (built from the Go module proxy by tools/build.sh and cached by
// content) on a real etcd (etcdenv), bound to 127.0.0.1 on free ports, with
// the Gateway API Inference Extension CRDs (v1.5.0) installed. There is no
// kubelet, scheduler or controller manager: tests create Pods and set their
// status themselves (SetPodStatus). It is for tests only.
//
// Authentication is by bearer token (--token-auth-file) and authorization by
// RBAC. The predefined users are:
//
//	admin       token "kubetest-admin"       group system:masters (AdminConfig, Client, Dynamic)
//	kvbandit    token "kubetest-kvbandit"    no permissions until a test grants them
//	kvbandit-2  token "kubetest-kvbandit-2"  no permissions until a test grants them
//	nobody      token "kubetest-nobody"      no permissions
//
// The kube-apiserver binary is found by [testenv.Tool]: KVBANDIT_KUBE_APISERVER
// when set, as the e2e suite passes it into its network namespace, otherwise
// built with tools/build.sh. The CRD directory comes from KVBANDIT_GIE_CRDS
// when set, otherwise from the module cache (`go mod download -json` in
// tools/epp).
package kubeenv

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/restmapper"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"k8s.io/client-go/util/retry"

	"github.com/kvbandit/kvbandit/internal/testenv"
	"github.com/kvbandit/kvbandit/internal/testenv/etcdenv"
)

// FieldManager is the server-side apply field manager of Apply.
const FieldManager = "kvbandit-test"

// ServiceClusterIPRange is the API server's --service-cluster-ip-range.
const ServiceClusterIPRange = "10.96.0.0/24"

// users maps each predefined user to its token and groups.
var users = map[string]struct{ token, groups string }{
	"admin":      {"kubetest-admin", "system:masters"},
	"kvbandit":   {"kubetest-kvbandit", ""},
	"kvbandit-2": {"kubetest-kvbandit-2", ""},
	"nobody":     {"kubetest-nobody", ""},
}

// Users lists the predefined users (see the package doc), sorted.
func Users() []string {
	names := make([]string, 0, len(users))
	for n := range users {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// Cluster is one API server on its own etcd. Kill and Restart may be called
// from the test goroutine; they are not meant to race with each other.
type Cluster struct {
	t    testing.TB
	bin  string
	dir  string
	etcd *etcdenv.Server
	port int
	ca   []byte // PEM of the CA that signed the serving certificate
	logs testenv.Log

	mu   sync.Mutex
	proc *testenv.Process
}

// Start starts etcd and kube-apiserver, waits for /readyz, installs the GIE
// CRDs and waits until they are Established. Everything is stopped when the
// test ends. A binary that cannot be built fails the test; it never skips.
func Start(t testing.TB) *Cluster {
	t.Helper()
	begin := time.Now()
	bin := testenv.Tool(t, "kube-apiserver")
	crds := CRDDir(t)
	c := &Cluster{t: t, bin: bin, dir: t.TempDir(), port: testenv.FreePort(t)}
	c.etcd = etcdenv.Start(t)
	etcdUp := time.Now()
	c.writeFiles()
	t.Cleanup(func() {
		c.stop()
		if t.Failed() {
			t.Logf("kube-apiserver output:\n%s", c.logs.String())
		}
	})
	c.start()
	ready := time.Now()
	c.installCRDs(crds)
	ms := func(d time.Duration) time.Duration { return d.Round(time.Millisecond) }
	t.Logf("kubeenv: API server %s ready with the GIE CRDs in %v (tools and etcd %v, kube-apiserver /readyz %v, CRDs %v)",
		c.URL(), ms(time.Since(begin)), ms(etcdUp.Sub(begin)), ms(ready.Sub(etcdUp)), ms(time.Since(ready)))
	return c
}

// URL is the API server's address, "https://127.0.0.1:port".
func (c *Cluster) URL() string { return "https://" + testenv.Loopback + ":" + strconv.Itoa(c.port) }

// Etcd is the cluster's etcd server.
func (c *Cluster) Etcd() *etcdenv.Server { return c.etcd }

// CAData is the PEM of the CA that signed the API server's certificate.
func (c *Cluster) CAData() []byte { return bytes.Clone(c.ca) }

// Token returns the bearer token of a predefined user.
func (c *Cluster) Token(user string) string {
	u, ok := users[user]
	if !ok {
		c.t.Fatalf("kubeenv: unknown user %q (have %v)", user, Users())
	}
	return u.token
}

// AdminConfig is a client configuration of the "admin" user (system:masters).
func (c *Cluster) AdminConfig() *rest.Config { return c.UserConfig("admin") }

// UserConfig is a client configuration of a predefined user: "admin",
// "kvbandit", "kvbandit-2" or "nobody". Only admin has permissions unless a
// test grants some with a Role and RoleBinding.
func (c *Cluster) UserConfig(user string) *rest.Config {
	return &rest.Config{
		Host:            c.URL(),
		BearerToken:     c.Token(user),
		TLSClientConfig: rest.TLSClientConfig{CAData: c.CAData()},
		QPS:             1000,
		Burst:           1000,
		Timeout:         30 * time.Second,
	}
}

// Kubeconfig writes a kubeconfig file for a predefined user into the test's
// temporary directory and returns its path (for binaries: --kubeconfig).
func (c *Cluster) Kubeconfig(t testing.TB, user string) string {
	t.Helper()
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["kubetest"] = &clientcmdapi.Cluster{Server: c.URL(), CertificateAuthorityData: c.CAData()}
	cfg.AuthInfos[user] = &clientcmdapi.AuthInfo{Token: c.Token(user)}
	cfg.Contexts["kubetest"] = &clientcmdapi.Context{Cluster: "kubetest", AuthInfo: user, Namespace: "default"}
	cfg.CurrentContext = "kubetest"
	path := filepath.Join(t.TempDir(), "kubeconfig-"+user)
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		t.Fatalf("kubeenv: write kubeconfig: %v", err)
	}
	return path
}

// Client is a typed client of the admin user.
func (c *Cluster) Client(t testing.TB) kubernetes.Interface {
	t.Helper()
	cs, err := kubernetes.NewForConfig(c.AdminConfig())
	if err != nil {
		t.Fatalf("kubeenv: client: %v", err)
	}
	return cs
}

// Dynamic is a dynamic client of the admin user.
func (c *Cluster) Dynamic(t testing.TB) dynamic.Interface {
	t.Helper()
	d, err := dynamic.NewForConfig(c.AdminConfig())
	if err != nil {
		t.Fatalf("kubeenv: dynamic client: %v", err)
	}
	return d
}

// Kill stops the API server with SIGKILL and waits for it to exit; etcd keeps
// running.
func (c *Cluster) Kill() { c.current().Kill() }

// Restart starts the API server again on the same port and the same etcd
// (after Kill, or stopping it first if it still runs) and waits for /readyz.
func (c *Cluster) Restart() {
	c.t.Helper()
	c.stop()
	c.start()
}

// CreateNamespace creates a namespace; one that exists already is fine.
// The first custom resource (an InferencePool) created in a namespace this
// new took about 2 s here (the API server's namespace admission catching
// up); Pods and the "default" namespace are not affected.
func (c *Cluster) CreateNamespace(t testing.TB, name string) {
	t.Helper()
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}
	_, err := c.Client(t).CoreV1().Namespaces().Create(ctx(t), ns, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatalf("kubeenv: create namespace %s: %v", name, err)
	}
}

// CreatePod creates a Pod with one container (image "kubetest", never run:
// there is no kubelet) and returns it as created. Its status stays Pending
// until SetPodStatus.
func (c *Cluster) CreatePod(t testing.TB, ns, name string, labels, annotations map[string]string) *corev1.Pod {
	t.Helper()
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: labels, Annotations: annotations},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: "kubetest"}}},
	}
	got, err := c.Client(t).CoreV1().Pods(ns).Create(ctx(t), pod, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("kubeenv: create pod %s/%s: %v", ns, name, err)
	}
	return got
}

// SetPodStatus writes a Pod's status as a kubelet would: phase Running,
// status.podIP and status.podIPs set to ip (cleared when ip is ""), and the
// Ready and ContainersReady conditions set to ready.
func (c *Cluster) SetPodStatus(t testing.TB, ns, name, ip string, ready bool) {
	t.Helper()
	pods := c.Client(t).CoreV1().Pods(ns)
	cond := corev1.ConditionFalse
	if ready {
		cond = corev1.ConditionTrue
	}
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		pod, err := pods.Get(ctx(t), name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		now := metav1.Now()
		pod.Status.Phase = corev1.PodRunning
		pod.Status.PodIP = ip
		pod.Status.PodIPs = nil
		if ip != "" {
			pod.Status.PodIPs = []corev1.PodIP{{IP: ip}}
		}
		if pod.Status.StartTime == nil {
			pod.Status.StartTime = &now
		}
		pod.Status.Conditions = []corev1.PodCondition{
			{Type: corev1.PodReady, Status: cond, LastTransitionTime: now},
			{Type: corev1.ContainersReady, Status: cond, LastTransitionTime: now},
		}
		_, err = pods.UpdateStatus(ctx(t), pod, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		t.Fatalf("kubeenv: set status of pod %s/%s: %v", ns, name, err)
	}
}

// Apply applies every YAML document of manifests with server-side apply
// (field manager "kvbandit-test", forcing conflicts), as the admin user, in
// order. Namespaced objects without a namespace go to "default". With dryRun
// the server validates and defaults everything but stores nothing
// (dryRun=All). It stops at the first error, which names the document's
// kind and name.
func (c *Cluster) Apply(ctx context.Context, manifests []byte, dryRun bool) error {
	dyn, err := dynamic.NewForConfig(c.AdminConfig())
	if err != nil {
		return err
	}
	dc, err := discovery.NewDiscoveryClientForConfig(c.AdminConfig())
	if err != nil {
		return err
	}
	mapper := restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(dc))
	opts := metav1.ApplyOptions{FieldManager: FieldManager, Force: true}
	if dryRun {
		opts.DryRun = []string{metav1.DryRunAll}
	}
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(manifests), 4096)
	for i := 0; ; i++ {
		var obj map[string]any
		if err := dec.Decode(&obj); errors.Is(err, io.EOF) {
			return nil
		} else if err != nil {
			return fmt.Errorf("document %d: %w", i, err)
		}
		if len(obj) == 0 {
			continue
		}
		u := &unstructured.Unstructured{Object: obj}
		what := fmt.Sprintf("document %d (%s %s)", i, u.GetKind(), u.GetName())
		gvk := u.GroupVersionKind()
		if gvk.Kind == "" || gvk.Version == "" {
			return fmt.Errorf("%s: no apiVersion or kind", what)
		}
		m, err := mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
		if meta.IsNoMatchError(err) {
			mapper.Reset() // a CRD applied by an earlier document
			m, err = mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
		}
		if err != nil {
			return fmt.Errorf("%s: %w", what, err)
		}
		var ri dynamic.ResourceInterface = dyn.Resource(m.Resource)
		if m.Scope.Name() == meta.RESTScopeNameNamespace {
			ns := u.GetNamespace()
			if ns == "" {
				ns = "default"
			}
			ri = dyn.Resource(m.Resource).Namespace(ns)
		}
		if _, err := ri.Apply(ctx, u.GetName(), u, opts); err != nil {
			return fmt.Errorf("%s: %w", what, err)
		}
	}
}

// GIEModule is the module whose config/crd/bases holds the CRDs; its version
// is the one pinned in tools/epp/go.mod.
const GIEModule = "sigs.k8s.io/gateway-api-inference-extension"

// CRDDir returns the directory of the GIE CRD manifests: KVBANDIT_GIE_CRDS
// when set, otherwise config/crd/bases of the module pinned in tools/epp,
// located in (or downloaded into) the module cache.
func CRDDir(t testing.TB) string {
	t.Helper()
	if dir := os.Getenv("KVBANDIT_GIE_CRDS"); dir != "" {
		return dir
	}
	cmd := exec.Command("go", "mod", "download", "-json", GIEModule)
	cmd.Dir = filepath.Join(testenv.RepoRoot(t), "tools", "epp")
	cmd.Env = append(os.Environ(), "GOWORK=off")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("kubeenv: go mod download %s (in tools/epp): %v\n%s%s", GIEModule, err, out, stderr.String())
	}
	var mod struct{ Dir, Error string }
	if err := json.Unmarshal(out, &mod); err != nil || mod.Dir == "" {
		t.Fatalf("kubeenv: go mod download %s: no Dir (%v %s)\n%s", GIEModule, err, mod.Error, out)
	}
	return filepath.Join(mod.Dir, "config", "crd", "bases")
}

// writeFiles generates the certificates, the service-account key and the
// token file in c.dir.
func (c *Cluster) writeFiles() {
	t := c.t
	t.Helper()
	ca, err := testenv.NewCA("kubetest-ca")
	if err != nil {
		t.Fatalf("kubeenv: %v", err)
	}
	serving, err := ca.Issue(&x509.Certificate{
		Subject:     pkix.Name{CommonName: "kube-apiserver"},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		DNSNames:    []string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"},
		IPAddresses: []net.IP{net.ParseIP(testenv.Loopback), net.IPv4(10, 96, 0, 1)},
	})
	if err != nil {
		t.Fatalf("kubeenv: %v", err)
	}
	saKey, err := testenv.NewKeyPEM()
	if err != nil {
		t.Fatalf("kubeenv: %v", err)
	}
	c.ca = ca.PEM
	var tokens strings.Builder
	for _, name := range Users() {
		u := users[name]
		fmt.Fprintf(&tokens, "%s,%s,%s", u.token, name, name)
		if u.groups != "" {
			fmt.Fprintf(&tokens, ",%q", u.groups)
		}
		tokens.WriteString("\n")
	}
	files := map[string][]byte{
		"ca.crt":     c.ca,
		"server.crt": serving.CertPEM,
		"server.key": serving.KeyPEM,
		"sa.key":     saKey,
		"tokens.csv": []byte(tokens.String()),
	}
	for name, data := range files {
		if err := os.WriteFile(filepath.Join(c.dir, name), data, 0o600); err != nil {
			t.Fatalf("kubeenv: %v", err)
		}
	}
}

func (c *Cluster) start() {
	c.t.Helper()
	f := func(name string) string { return filepath.Join(c.dir, name) }
	proc, err := testenv.Start(c.bin, []string{
		"--bind-address=" + testenv.Loopback,
		"--advertise-address=" + testenv.Loopback,
		"--secure-port=" + strconv.Itoa(c.port),
		"--etcd-servers=" + c.etcd.URL(),
		"--cert-dir=" + f("certs"),
		"--tls-cert-file=" + f("server.crt"),
		"--tls-private-key-file=" + f("server.key"),
		"--client-ca-file=" + f("ca.crt"),
		"--service-account-key-file=" + f("sa.key"),
		"--service-account-signing-key-file=" + f("sa.key"),
		"--service-account-issuer=https://kubernetes.default.svc",
		"--service-cluster-ip-range=" + ServiceClusterIPRange,
		"--authorization-mode=RBAC",
		"--token-auth-file=" + f("tokens.csv"),
		"--disable-admission-plugins=ServiceAccount",
		"--profiling=false",
		"--v=0",
	}, &c.logs)
	if err != nil {
		c.t.Fatalf("kubeenv: %v", err)
	}
	c.mu.Lock()
	c.proc = proc
	c.mu.Unlock()
	c.waitReady(proc)
}

// waitReady polls /readyz until it answers 200.
func (c *Cluster) waitReady(proc *testenv.Process) {
	c.t.Helper()
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(c.ca)
	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}
	defer tr.CloseIdleConnections()
	hc := &http.Client{Timeout: 2 * time.Second, Transport: tr}
	err := proc.WaitReady(60*time.Second, 50*time.Millisecond, func() (bool, error) {
		req, _ := http.NewRequest(http.MethodGet, c.URL()+"/readyz", nil)
		req.Header.Set("Authorization", "Bearer "+users["admin"].token)
		resp, err := hc.Do(req)
		if err != nil {
			return false, err
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode == http.StatusOK {
			return true, nil
		}
		return false, fmt.Errorf("/readyz: %d %s", resp.StatusCode, body)
	})
	if err != nil {
		c.t.Fatalf("kubeenv: %v\n%s", err, c.logs.String())
	}
}

var crdGVR = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}

// installCRDs creates every CRD in dir and waits until each is Established.
func (c *Cluster) installCRDs(dir string) {
	t := c.t
	t.Helper()
	paths, err := filepath.Glob(filepath.Join(dir, "*.yaml"))
	if err != nil || len(paths) == 0 {
		t.Fatalf("kubeenv: no CRD manifests in %s (%v)", dir, err)
	}
	crds := c.Dynamic(t).Resource(crdGVR)
	var names []string
	for _, p := range paths {
		data, err := os.ReadFile(p)
		if err != nil {
			t.Fatalf("kubeenv: %v", err)
		}
		var obj map[string]any
		if err := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(data), 4096).Decode(&obj); err != nil {
			t.Fatalf("kubeenv: %s: %v", p, err)
		}
		u := &unstructured.Unstructured{Object: obj}
		if u.GetKind() != "CustomResourceDefinition" {
			continue
		}
		if _, err := crds.Create(ctx(t), u, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatalf("kubeenv: create CRD %s: %v", u.GetName(), err)
		}
		names = append(names, u.GetName())
	}
	deadline := time.Now().Add(30 * time.Second)
	for _, name := range names {
		for {
			u, err := crds.Get(ctx(t), name, metav1.GetOptions{})
			if err == nil && established(u) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("kubeenv: CRD %s not Established after 30s (%v)", name, err)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	// Established is not yet served everywhere: wait until every served
	// version lists, so a test's first request does not wait or fail.
	for _, name := range names {
		u, err := crds.Get(ctx(t), name, metav1.GetOptions{})
		if err != nil {
			t.Fatalf("kubeenv: CRD %s: %v", name, err)
		}
		group, _, _ := unstructured.NestedString(u.Object, "spec", "group")
		plural, _, _ := unstructured.NestedString(u.Object, "spec", "names", "plural")
		versions, _, _ := unstructured.NestedSlice(u.Object, "spec", "versions")
		for _, v := range versions {
			m, _ := v.(map[string]any)
			version, _ := m["name"].(string)
			if served, _ := m["served"].(bool); !served {
				continue
			}
			res := c.Dynamic(t).Resource(schema.GroupVersionResource{Group: group, Version: version, Resource: plural})
			for {
				_, err := res.List(ctx(t), metav1.ListOptions{Limit: 1})
				if err == nil {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("kubeenv: %s/%s %s not served after 30s: %v", group, version, plural, err)
				}
				time.Sleep(20 * time.Millisecond)
			}
		}
	}
}

func established(u *unstructured.Unstructured) bool {
	conds, _, _ := unstructured.NestedSlice(u.Object, "status", "conditions")
	for _, c := range conds {
		m, _ := c.(map[string]any)
		if m["type"] == "Established" && m["status"] == "True" {
			return true
		}
	}
	return false
}

// stop sends SIGTERM, then SIGKILL after 5s, and waits for the exit.
func (c *Cluster) stop() { c.current().Stop() }

func (c *Cluster) current() *testenv.Process {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.proc
}

// ctx is a context for one API call of a helper: the test's, with a timeout.
func ctx(t testing.TB) context.Context {
	c, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	t.Cleanup(cancel)
	return c
}

// String describes the cluster for test logs.
func (c *Cluster) String() string { return "kube-apiserver@" + c.URL() }
