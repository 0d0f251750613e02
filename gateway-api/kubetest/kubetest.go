// Package kubetest runs a real Kubernetes API server for tests: kube-apiserver
// v1.36.3 (built from the Go module proxy by tools/build.sh and cached by
// content) on a real etcd (etcdtest), bound to 127.0.0.1 on free ports, with
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
// The binaries come from environment variables when set (KVBANDIT_KUBE_APISERVER,
// and for Tool: KVBANDIT_HELM, KVBANDIT_EPP), as the e2e suite passes them into
// its network namespace; otherwise they are built with tools/build.sh. The CRD
// directory comes from KVBANDIT_GIE_CRDS when set, otherwise from the module
// cache (`go mod download -json` in tools/epp).
package kubetest

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"github.com/kvbandit/kvbandit/internal/toolstest"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
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

	"github.com/kvbandit/kvbandit/routing/discovery/etcd/etcdtest"
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
	etcd *etcdtest.Server
	port int
	ca   []byte // PEM of the CA that signed the serving certificate

	mu   sync.Mutex
	cmd  *exec.Cmd
	done <-chan struct{} // closed when cmd has exited
	logs bytes.Buffer
}

// Start starts etcd and kube-apiserver, waits for /readyz, installs the GIE
// CRDs and waits until they are Established. Everything is stopped when the
// test ends. A binary that cannot be built fails the test; it never skips.
func Start(t testing.TB) *Cluster {
	t.Helper()
	begin := time.Now()
	bin := Tool(t, "kube-apiserver")
	crds := CRDDir(t)
	c := &Cluster{t: t, bin: bin, dir: t.TempDir(), port: toolstest.FreePort(t)}
	c.etcd = etcdtest.Start(t)
	etcdUp := time.Now()
	c.writeFiles()
	t.Cleanup(func() {
		c.stop()
		if t.Failed() {
			c.mu.Lock()
			t.Logf("kube-apiserver output:\n%s", c.logs.String())
			c.mu.Unlock()
		}
	})
	c.start()
	ready := time.Now()
	c.installCRDs(crds)
	ms := func(d time.Duration) time.Duration { return d.Round(time.Millisecond) }
	t.Logf("kubetest: API server %s ready with the GIE CRDs in %v (tools and etcd %v, kube-apiserver /readyz %v, CRDs %v)",
		c.URL(), ms(time.Since(begin)), ms(etcdUp.Sub(begin)), ms(ready.Sub(etcdUp)), ms(time.Since(ready)))
	return c
}

// URL is the API server's address, "https://127.0.0.1:port".
func (c *Cluster) URL() string { return "https://127.0.0.1:" + strconv.Itoa(c.port) }

// Etcd is the cluster's etcd server.
func (c *Cluster) Etcd() *etcdtest.Server { return c.etcd }

// CAData is the PEM of the CA that signed the API server's certificate.
func (c *Cluster) CAData() []byte { return bytes.Clone(c.ca) }

// Token returns the bearer token of a predefined user.
func (c *Cluster) Token(user string) string {
	u, ok := users[user]
	if !ok {
		c.t.Fatalf("kubetest: unknown user %q (have %v)", user, Users())
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
		t.Fatalf("kubetest: write kubeconfig: %v", err)
	}
	return path
}

// Client is a typed client of the admin user.
func (c *Cluster) Client(t testing.TB) kubernetes.Interface {
	t.Helper()
	cs, err := kubernetes.NewForConfig(c.AdminConfig())
	if err != nil {
		t.Fatalf("kubetest: client: %v", err)
	}
	return cs
}

// Dynamic is a dynamic client of the admin user.
func (c *Cluster) Dynamic(t testing.TB) dynamic.Interface {
	t.Helper()
	d, err := dynamic.NewForConfig(c.AdminConfig())
	if err != nil {
		t.Fatalf("kubetest: dynamic client: %v", err)
	}
	return d
}

// Kill stops the API server with SIGKILL and waits for it to exit; etcd keeps
// running.
func (c *Cluster) Kill() { c.signal(syscall.SIGKILL, 0) }

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
		t.Fatalf("kubetest: create namespace %s: %v", name, err)
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
		t.Fatalf("kubetest: create pod %s/%s: %v", ns, name, err)
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
		t.Fatalf("kubetest: set status of pod %s/%s: %v", ns, name, err)
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

// Tool returns the path of a tools binary (kube-apiserver, helm, epp, etcd,
// llm-d-inference-sim); see [toolstest.Tool].
func Tool(t testing.TB, name string) string { t.Helper(); return toolstest.Tool(t, name) }

// CRDDir returns the directory of the GIE CRD manifests: KVBANDIT_GIE_CRDS
// when set, otherwise config/crd/bases of the module pinned in tools/epp,
// located in (or downloaded into) the module cache.
func CRDDir(t testing.TB) string {
	t.Helper()
	if dir := os.Getenv("KVBANDIT_GIE_CRDS"); dir != "" {
		return dir
	}
	cmd := exec.Command("go", "mod", "download", "-json", GIEModule)
	cmd.Dir = filepath.Join(toolstest.RepoRoot(t), "tools", "epp")
	cmd.Env = append(os.Environ(), "GOWORK=off")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("kubetest: go mod download %s (in tools/epp): %v\n%s%s", GIEModule, err, out, stderr.String())
	}
	var mod struct{ Dir, Error string }
	if err := json.Unmarshal(out, &mod); err != nil || mod.Dir == "" {
		t.Fatalf("kubetest: go mod download %s: no Dir (%v %s)\n%s", GIEModule, err, mod.Error, out)
	}
	return filepath.Join(mod.Dir, "config", "crd", "bases")
}

// writeFiles generates the certificates, the service-account key and the
// token file in c.dir.
func (c *Cluster) writeFiles() {
	t := c.t
	t.Helper()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatalf("kubetest: %v", err)
	}
	now := time.Now()
	caTmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "kubetest-ca"},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatalf("kubetest: %v", err)
	}
	caCert, err := x509.ParseCertificate(caDER)
	if err != nil {
		t.Fatalf("kubetest: %v", err)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatalf("kubetest: %v", err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(2),
		Subject:      pkix.Name{CommonName: "kube-apiserver"},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		DNSNames:     []string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"},
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1), net.IPv4(10, 96, 0, 1)},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &key.PublicKey, caKey)
	if err != nil {
		t.Fatalf("kubetest: %v", err)
	}
	saKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatalf("kubetest: %v", err)
	}
	c.ca = pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER})
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
		"server.crt": pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		"server.key": ecKeyPEM(t, key),
		"sa.key":     ecKeyPEM(t, saKey),
		"tokens.csv": []byte(tokens.String()),
	}
	for name, data := range files {
		if err := os.WriteFile(filepath.Join(c.dir, name), data, 0o600); err != nil {
			t.Fatalf("kubetest: %v", err)
		}
	}
}

func ecKeyPEM(t testing.TB, key *ecdsa.PrivateKey) []byte {
	t.Helper()
	der, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatalf("kubetest: %v", err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der})
}

func (c *Cluster) start() {
	c.t.Helper()
	f := func(name string) string { return filepath.Join(c.dir, name) }
	cmd := exec.Command(c.bin,
		"--bind-address=127.0.0.1",
		"--advertise-address=127.0.0.1",
		"--secure-port="+strconv.Itoa(c.port),
		"--etcd-servers="+c.etcd.URL(),
		"--cert-dir="+f("certs"),
		"--tls-cert-file="+f("server.crt"),
		"--tls-private-key-file="+f("server.key"),
		"--client-ca-file="+f("ca.crt"),
		"--service-account-key-file="+f("sa.key"),
		"--service-account-signing-key-file="+f("sa.key"),
		"--service-account-issuer=https://kubernetes.default.svc",
		"--service-cluster-ip-range="+ServiceClusterIPRange,
		"--authorization-mode=RBAC",
		"--token-auth-file="+f("tokens.csv"),
		"--disable-admission-plugins=ServiceAccount",
		"--profiling=false",
		"--v=0",
	)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	c.mu.Lock()
	cmd.Stdout = &lockedWriter{mu: &c.mu, w: &c.logs}
	cmd.Stderr = cmd.Stdout
	c.mu.Unlock()
	if err := cmd.Start(); err != nil {
		c.t.Fatalf("kubetest: start kube-apiserver: %v", err)
	}
	done := toolstest.Wait(cmd)
	c.mu.Lock()
	c.cmd, c.done = cmd, done
	c.mu.Unlock()
	c.waitReady(done)
}

// waitReady polls /readyz until it answers 200.
func (c *Cluster) waitReady(exited <-chan struct{}) {
	c.t.Helper()
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(c.ca)
	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}
	defer tr.CloseIdleConnections()
	hc := &http.Client{Timeout: 2 * time.Second, Transport: tr}
	deadline := time.Now().Add(60 * time.Second)
	last := ""
	for time.Now().Before(deadline) {
		select {
		case <-exited:
			c.mu.Lock()
			logs := c.logs.String()
			c.mu.Unlock()
			c.t.Fatalf("kubetest: kube-apiserver exited during startup:\n%s", logs)
		default:
		}
		req, _ := http.NewRequest(http.MethodGet, c.URL()+"/readyz", nil)
		req.Header.Set("Authorization", "Bearer "+users["admin"].token)
		resp, err := hc.Do(req)
		if err == nil {
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
			last = fmt.Sprintf("%d %s", resp.StatusCode, body)
		} else {
			last = err.Error()
		}
		time.Sleep(50 * time.Millisecond)
	}
	c.t.Fatalf("kubetest: kube-apiserver on %s not ready after 60s: %s", c.URL(), last)
}

var crdGVR = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}

// installCRDs creates every CRD in dir and waits until each is Established.
func (c *Cluster) installCRDs(dir string) {
	t := c.t
	t.Helper()
	paths, err := filepath.Glob(filepath.Join(dir, "*.yaml"))
	if err != nil || len(paths) == 0 {
		t.Fatalf("kubetest: no CRD manifests in %s (%v)", dir, err)
	}
	crds := c.Dynamic(t).Resource(crdGVR)
	var names []string
	for _, p := range paths {
		data, err := os.ReadFile(p)
		if err != nil {
			t.Fatalf("kubetest: %v", err)
		}
		var obj map[string]any
		if err := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(data), 4096).Decode(&obj); err != nil {
			t.Fatalf("kubetest: %s: %v", p, err)
		}
		u := &unstructured.Unstructured{Object: obj}
		if u.GetKind() != "CustomResourceDefinition" {
			continue
		}
		if _, err := crds.Create(ctx(t), u, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatalf("kubetest: create CRD %s: %v", u.GetName(), err)
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
				t.Fatalf("kubetest: CRD %s not Established after 30s (%v)", name, err)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	// Established is not yet served everywhere: wait until every served
	// version lists, so a test's first request does not wait or fail.
	for _, name := range names {
		u, err := crds.Get(ctx(t), name, metav1.GetOptions{})
		if err != nil {
			t.Fatalf("kubetest: CRD %s: %v", name, err)
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
					t.Fatalf("kubetest: %s/%s %s not served after 30s: %v", group, version, plural, err)
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
func (c *Cluster) stop() { c.signal(syscall.SIGTERM, 5*time.Second) }

func (c *Cluster) signal(sig syscall.Signal, grace time.Duration) {
	c.mu.Lock()
	cmd, done := c.cmd, c.done
	c.mu.Unlock()
	toolstest.Stop(cmd, done, sig, grace)
}

// ctx is a context for one API call of a helper: the test's, with a timeout.
func ctx(t testing.TB) context.Context {
	c, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	t.Cleanup(cancel)
	return c
}

type lockedWriter struct {
	mu *sync.Mutex
	w  *bytes.Buffer
}

func (w *lockedWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.w.Len() > 1<<20 {
		return len(p), nil
	}
	return w.w.Write(p)
}

// String describes the cluster for test logs.
func (c *Cluster) String() string { return "kube-apiserver@" + c.URL() }
